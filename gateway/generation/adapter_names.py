"""The gateway's copy of the scheduler's LoRA adapter list, and what a request's `model` picks from it.

The scheduler keeps the list (adapter_registry.py); a gateway asks again whenever a request names a model its copy
lacks, so a gateway restart loses nothing and an adapter loaded through one gateway is usable through all at once.
"""

from __future__ import annotations

import logging
import time

import grpc

from stepwire.contract import InvalidRequestError
from stepwire.contract.limits import ADAPTER_NAME as NAME
from stepwire.internal import scheduler_pb2


class ModelNotFound(InvalidRequestError):
    """A request named a model that is neither the served one nor a loaded adapter."""

    def __init__(self, name: str, served: str | list[str]):
        shown = name if len(name) <= 100 else name[:100] + "..."
        served = repr(served) if isinstance(served, str) else ", ".join(map(repr, served))
        super().__init__("model", f"the model {shown!r} does not exist; this server serves {served} and the "
                                  "LoRA adapters /v1/models lists")


log = logging.getLogger("stepwire.gateway")
# A name that can never be an adapter's is refused without asking; others ask at most this often, so a flood of
# requests for unknown models costs the scheduler one RPC a period, not one each.
REFRESH_SECONDS = 0.5


class AdapterNames:
    """The gateway's copy of the scheduler's adapter list."""

    def __init__(self):
        self.known: dict[str, scheduler_pb2.AdapterInfo] = {}
        self.asked = -REFRESH_SECONDS

    async def refresh(self, stub) -> list[scheduler_pb2.AdapterInfo]:
        self.asked = time.monotonic()
        try:
            resp = await stub.Adapters(scheduler_pb2.AdaptersRequest(), timeout=5)
        except grpc.RpcError:
            return list(self.known.values())    # the scheduler is away: the last list known
        self.known = {a.name: a for a in resp.adapters}
        return list(resp.adapters)

    async def restore(self, stub) -> list[str]:
        """After the scheduler was lost and is back: load again the adapters this gateway knew that it lacks (a
        new scheduler knows only its --lora-modules), before held requests are resubmitted for them. Returns the
        names loaded; another gateway doing the same at once is no error (ALREADY_EXISTS)."""
        before = dict(self.known)
        now = {a.name for a in await self.refresh(stub)}
        restored = []
        for name, a in before.items():
            if name in now:
                continue
            try:
                await stub.LoadAdapter(scheduler_pb2.LoadAdapterRequest(name=name, path=a.path), timeout=70)
                restored.append(name)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                    log.warning("LoRA adapter %s could not be loaded again after the scheduler came back: %s",
                                name, e.details())
        if restored:
            log.info("LoRA adapters loaded again on the scheduler that came back: %s", ", ".join(restored))
            await self.refresh(stub)
        return restored

    async def resolve(self, backend, name: str) -> str:
        """The adapter `name` picks: "" for the served model (or no name), else a loaded adapter's name."""
        if not name or name == backend.model_name:
            return ""
        if name not in self.known:
            if NAME.fullmatch(name) and time.monotonic() - self.asked >= REFRESH_SECONDS:
                await self.refresh(backend.stub)
            if name not in self.known:
                raise ModelNotFound(name, backend.model_name)
        return name
