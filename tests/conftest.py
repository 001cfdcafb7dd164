import contextlib
import sys
from pathlib import Path
from typing import NamedTuple

import pytest


def _interpret_triton_without_a_gpu() -> None:
    """Triton decides when triton.language is first imported whether its kernels run interpreted, and any test
    may import it first (through transformers, say): without a GPU the kernel tests run the kernels on the CPU
    through the interpreter, so it is chosen here, before any test module is collected."""
    import os

    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()


def _float32_unless_a_test_says_otherwise() -> None:
    """On CPUs with AMX or AVX512-BF16 the executor defaults to bfloat16, where a token can flip with the batch's
    shape. Tests that compare tokens with transformers, across batch shapes or across faults do so in float32,
    chosen here for every executor process and in-process engine they start; the tests of deterministic mode
    choose bfloat16 themselves, and the tests of the default choose it by clearing this."""
    import os

    os.environ.setdefault("STEPWIRE_EXECUTOR_DTYPE", "float32")


_float32_unless_a_test_says_otherwise()


def _kv_cache_left_to_fault_in() -> None:
    """The suite starts dozens of executors, most with the default 1 GiB KV budget, three workers at a time:
    resident, their caches would hold over 10 GiB and cost seconds of a core each on a fresh VM. They leave
    their pages to the first write, as before; test_kv_cache_resident checks the default itself."""
    import os

    os.environ.setdefault("STEPWIRE_EXECUTOR_KV_CACHE_RESIDENT", "false")
    # In shared memory (the default, --kv-shared-memory-dir), a cache is reserved whole at start: the same
    # memory and time. The tests of KV in shared memory choose a directory themselves.
    os.environ.setdefault("STEPWIRE_EXECUTOR_KV_SHARED_MEMORY_DIR", "")


_kv_cache_left_to_fault_in()


def _one_core_per_test_worker() -> None:
    """`make test` runs the tests in more workers than cores (pytest-xdist), each starting its own services: an
    executor (or this process) taking a torch thread per core would have the workers' threads fight over each
    core, and OpenMP's idle threads spin while they wait, burning a core another worker needs."""
    import os

    import torch
    os.environ.setdefault("STEPWIRE_EXECUTOR_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


_one_core_per_test_worker()


def _fork_services() -> None:
    """Every Stack of the tests forks its services from a server that imported them once (launcher/forked.py):
    the suite starts about 170 of them, and each would spend most of its start importing torch or gRPC."""
    import launcher.processes
    launcher.processes.FORK = True


_fork_services()


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core this process may run on and one more, since a worker often waits (on a
    deadline, a restart, a keepalive) with its core idle; at most 5, as each worker's stacks hold models in
    memory. On 2 cores, 3 workers ran the suite in 424 s where 2 took 464 s."""
    import os

    return min(len(os.sched_getaffinity(0)) + 1, 5)

# Tests import the packages from the checkout, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


class HttpStack(NamedTuple):
    url: str          # the gateway's HTTP root
    client: object    # an openai.OpenAI client on it
    sc: int           # the scheduler's port
    gw: int           # the gateway's gRPC port


def http_status(url: str) -> int | None:
    import httpx

    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


@pytest.fixture
def launch(tmp_path):
    """Start services as one launcher.processes.Stack: `launch(Service(...), ..., wait=True)`, logging in this
    test's folder; every stack is stopped when the test ends, failing it if a member died on its own."""
    from launcher.processes import Stack

    with contextlib.ExitStack() as stacks:
        yield lambda *services, **kw: stacks.enter_context(Stack(list(services), kw.pop("workdir", tmp_path), **kw))


@pytest.fixture(scope="session")
def shallow() -> Path:
    """The embedded model cut to its first layers (tests/shallow_model.py), for tests of the engine's mechanics."""
    if not (MODEL / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    from shallow_model import shallow_model
    return shallow_model()


@pytest.fixture(scope="session")
def http_stack(tmp_path_factory) -> HttpStack:
    """The three services from the default model, started in the wrong order on purpose; shared by every
    test that drives the stack through its public APIs (one start-up for all of them)."""
    pytest.importorskip("torch")
    openai = pytest.importorskip("openai")
    import grpc
    from grpc_health.v1 import health_pb2
    from helpers import grpc_health

    from launcher.processes import Service, Stack

    if not (MODEL / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    # Deliberately the wrong way round: gateway, then scheduler, then executor. Each waits for the next.
    services = [Service("executor", flags={"--model": MODEL, "--kv-cache-memory": 256 << 20,
                                           "--max-model-len": 2048}, autostart=False),
                # A stream whose client hangs up is kept for a resume, parked after 16 unread tokens (and its blocks
                # freed): test_e2e_http's disconnect test waits for that, not for a 500-token story to end.
                Service("scheduler", flags={"--resume-buffer-tokens": 16}, autostart=False),
                Service("gateway", flags={"--model": MODEL}, autostart=False)]
    with Stack(services, tmp_path_factory.mktemp("logs"), wait=False) as stack:
        url, sc = stack["gateway"].url, stack["scheduler"].address
        # Each is up, and not ready because the next one is missing, before the next one starts.
        with grpc.insecure_channel(sc) as sc_channel:
            stack.start("gateway")
            stack.wait_until(lambda: http_status(url + "/health") == 503, "the gateway to answer /health with 503")
            stack.start("scheduler")
            stack.wait_until(lambda: grpc_health(sc_channel) == health_pb2.HealthCheckResponse.NOT_SERVING,
                             "the scheduler to report NOT_SERVING")
        stack.start("executor")
        stack.wait_ready("gateway")
        yield HttpStack(url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
                        int(sc.rsplit(":", 1)[1]), int(stack["gateway"].address.rsplit(":", 1)[1]))


@pytest.fixture(autouse=True)
def _triton_dot_as_a_gpu_computes_it(request, monkeypatch):
    """Through Triton's CPU interpreter `tl.dot` is numpy's matmul, which is OpenBLAS's sgemm: on some CPUs (its
    Haswell/Zen kernels, AVX2-only EPYCs) a row's low bits depend on where the row sits in the tile, which no
    GPU's matrix unit does and no kernel can help. Tests that run kernels through the interpreter (marked
    `interpreted`) get a dot whose every element is its row and column alone, summed in one order, so what they
    check of a kernel (a row's bits in a call of any size) holds on every CPU as it does on a GPU."""
    import os

    if request.node.get_closest_marker("interpreted") is None or os.environ.get("TRITON_INTERPRET") != "1":
        return
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype.itemsize == 1 or b.data.dtype.itemsize == 1:      # fp8: Triton's own conversion first
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        dtype = d.data.dtype
        # (m, k, n) products, summed over k in order: each output element from its own row and column only.
        products = a.data.astype(dtype)[..., :, :, None] * b.data.astype(dtype)[..., None, :, :]
        return interpreter.TensorHandle(products.sum(axis=-2, dtype=dtype) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
