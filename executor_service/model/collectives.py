"""The collectives a tensor-parallel forward needs: all-reduce of partial sums, and the logits to rank 0.

`Collectives()` is the single-rank group: every call returns its input, so a TP=1 model runs no collective
at all. A larger group runs over torch.distributed, gloo on CPU and NCCL on CUDA, and every call has the
group's timeout, so a rank that stops answering ends the step with `RankFailure` instead of hanging it.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F


class RankFailure(RuntimeError):
    """A rank of this executor died, stopped answering within the timeout, or failed mid-step: the ranks
    can no longer agree on the batch, so the executor must stop and let the scheduler move its requests."""


class Collectives:
    def __init__(self, rank: int = 0, size: int = 1):
        self.rank, self.size = rank, size
        # Wall time inside each kind of collective, waiting for slower ranks included (on CUDA: launching them).
        self.seconds = {"all-reduce": 0.0, "gather": 0.0, "all-gather": 0.0}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place."""
        if self.size > 1:
            self._run("all-reduce", dist.all_reduce, x)
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's [rows, widths[rank]] side by side on every rank: numbers moved, never added."""
        if self.size == 1:
            return x
        # Gloo gathers equal shapes only: uneven slices (3 KV heads over 2 ranks) travel padded.
        w = max(widths)
        mine = F.pad(x, (0, w - x.shape[1])) if x.shape[1] < w else x.contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._run("all-gather", dist.all_gather, parts, mine)
        return torch.cat([p[:, :n] for p, n in zip(parts, widths, strict=True)], dim=1)

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0 gets the whole [rows, vocab] from each rank's equal slice of columns; the others None."""
        if self.size == 1:
            return local[:, :vocab_size]
        if local.shape[0] == 0:   # every rank knows no row samples this step, so none joins a collective
            return local.new_empty(0, vocab_size) if self.rank == 0 else None
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        self._run("gather", dist.gather, local.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=1)[:, :vocab_size] if parts is not None else None

    def _run(self, what: str, collective, *args, **kw) -> None:
        t0 = time.perf_counter()
        try:
            collective(*args, **kw)
        except RuntimeError as e:   # gloo and NCCL report a dead or silent peer as RuntimeError subclasses
            raise RankFailure(f"tensor-parallel {what} on rank {self.rank} failed: {str(e)[:300]}") from e
        self.seconds[what] += time.perf_counter() - t0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def open_store(size: int, timeout: float) -> dist.TCPStore:
    """Rank 0's rendezvous on a free loopback port (the ranks of one executor share its pod)."""
    return dist.TCPStore("127.0.0.1", 0, size, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)


def join(rank: int, size: int, store: dist.TCPStore | int, device: torch.device, timeout: float) -> Collectives:
    """Join the executor's group: rank 0 with the store it opened, the others with its port."""
    # Gloo's transport binds to the interface of the host name unless told otherwise; the ranks of one
    # executor are in one pod, so loopback always reaches them, whatever the pod's network looks like.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if isinstance(store, int):
        store = dist.TCPStore("127.0.0.1", store, size, False, timeout=timedelta(seconds=timeout))
    try:
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout),
                                device_id=device if device.type == "cuda" else None)
    except RuntimeError as e:
        raise RankFailure(f"rank {rank} could not join the tensor-parallel group of {size}: {e}") from e
    return Collectives(rank, size)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
