"""A tensor-parallel rank other than 0: a process rank 0 starts, feeds step diffs, and stops.

It joins the executor's torch.distributed group, loads only its slice of the weights, and allocates the KV
cache of its own heads. Then, for every diff rank 0 hands over (`ranks.py`), it applies rank 0's sampled
tokens of the step before and the diff itself to its own persistent batch, and runs its shard of the
forward, meeting the other ranks in the all-reduces and giving its vocabulary columns of the logits to
rank 0.

It never outlives the executor: it exits when rank 0's socket ends or its parent process changes, and when
a collective fails or times out. SIGINT and SIGTERM are ignored: rank 0 receives them and decides.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import nullcontext

import torch

from executor_service.batch.wire import decode_step
from executor_service.engine.ranks import RESET, STEP, recv_message, send_message, unframe
from executor_service.engine.runner import ModelRunner
from executor_service.engine.runner_config import RunnerConfig
from executor_service.model.collectives import RankFailure
from observability import tracing
from stepwire.internal import executor_pb2

log = logging.getLogger("stepwire.executor")


def follow(runner: ModelRunner, sock: socket.socket, rank: int) -> int:
    """Apply rank 0's diffs until it says stop (0) or goes away (1)."""
    last = None     # the inputs of this rank's last step, to which rank 0's next frame brings the tokens
    while True:
        try:
            kind, sampled, traceparent, wire = unframe(recv_message(sock))
        except (EOFError, OSError):
            log.error("rank %d: rank 0 is gone; exiting", rank)
            return 1
        if kind == RESET:
            runner.reset_batch()
            last = None
        elif kind == STEP:
            if last is not None:
                runner.batch.append_sampled(last, sampled)
            msg = executor_pb2.StepRequest.FromString(wire)
            tracer = tracing.tracer()
            span = nullcontext() if tracer is None or not traceparent else tracer.start_as_current_span(
                "executor.rank_step", context=tracing.from_traceparent(traceparent),
                attributes={"stepwire.tp_rank": rank, "stepwire.step": msg.step})
            with span:
                last = runner.follow(decode_step(msg))
        else:
            return 0


def _exit_with_parent(parent: int) -> None:
    if os.getppid() != parent:   # rank 0 died while this process was still importing
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = spec["rank"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(name)s[rank {rank}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(spec["parent"])
    sock = socket.socket(fileno=spec["fd"])
    tracing.setup("stepwire-executor")
    try:
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        send_message(sock, json.dumps({"joining": True}).encode())   # rank 0 joins once every rank says this
        runner = ModelRunner(RunnerConfig(**spec["config"]), rank=rank, store_port=spec["store_port"])
    except Exception as e:
        log.exception("rank %d failed to start", rank)
        send_message(sock, json.dumps({"error": f"{type(e).__name__}: {str(e)[:500]}"}).encode())
        os._exit(1)
    send_message(sock, json.dumps({"ready": runner.num_blocks}).encode())
    try:
        code = follow(runner, sock, rank)
    except RankFailure as e:
        log.error("%s; exiting", e)
        code = 1
    except Exception:
        log.exception("rank %d: step failed; exiting, which stops the executor", rank)
        code = 1
    tracing.shutdown()
    # Not sys.exit: a thread still inside a collective must not keep this process alive.
    os._exit(code)


if __name__ == "__main__":
    main()
