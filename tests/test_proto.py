"""The generated Python modules never drift from the .proto contract."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.processes   # runs other processes: not in `make test-fast`


def test_generated_modules_equal_a_fresh_generation_from_the_protos():
    proc = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_contract_has_the_services_the_design_names():
    from stepwire.internal import executor_pb2, scheduler_pb2
    from stepwire.v1 import generation_pb2

    def methods(mod, service):
        return set(mod.DESCRIPTOR.services_by_name[service].methods_by_name)

    assert methods(generation_pb2, "Generation") == {"Generate", "GenerateStream", "Tokenize", "ModelInfo", "Resume"}
    # No Abort by id: only the call that submitted a request may end it.
    # Limits for gateways, Stats for the operator: a gateway's certificate cannot read the fleet.
    # Adapters, LoadAdapter and UnloadAdapter for gateways (behind their API keys) and the operator;
    # StoreResponse and LoadResponse (the Responses API's stored responses) for gateways.
    assert methods(scheduler_pb2, "Scheduler") == {"Submit", "Session", "Limits", "Stats", "Adapters",
                                                   "LoadAdapter", "UnloadAdapter", "StoreResponse", "LoadResponse"}
    # PullBlocks for the scheduler, ReadBlocks (and ReadBlocksMapped, on one host) for a peer executor: KV bytes
    # never pass the scheduler; CheckAdapter for the scheduler, which checks an adapter on an executor before it
    # registers it.
    assert methods(executor_pb2, "Executor") == {"Describe", "Step", "PullBlocks", "ReadBlocks", "ReadBlocksMapped",
                                                 "CheckAdapter"}
    step = executor_pb2.StepRequest.DESCRIPTOR
    assert "traceparent" in step.fields_by_name and "epoch" in step.fields_by_name
    # Repeated numbers are packed (proto3 default for scalars): no per-element tags on the wire.
    assert all(f.is_packed for f in step.fields if f.is_repeated and f.type != f.TYPE_MESSAGE)
