"""The fleet's LoRA adapters by name: registered at start (--lora-modules) or at run time (LoadAdapter).

An adapter is registered only after an executor that serves adapters has read and checked it (CheckAdapter), so a
file that cannot be served is refused at the edge, with the executor's reason, and never reaches a step. Each
registration gets its own key (`name@n`), which is what slots and block hashes carry (adapter_slots.py).

Start-time adapters are checked as soon as an executor that serves adapters is connected; until then a request
for one waits like any request for which no executor is ready. One that fails its check is dropped with a log
line. Unloading takes the name away at once; requests already running under it finish under it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import grpc

from stepwire.contract.limits import ADAPTER_NAME as NAME
from stepwire.internal import executor_pb2, scheduler_pb2

log = logging.getLogger("stepwire.scheduler")
MAX_PATH_CHARS = 4096


class AdapterRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True, slots=True)
class Registered:
    name: str
    key: str
    path: str
    rank: int
    created: float

    def info(self) -> scheduler_pb2.AdapterInfo:
        return scheduler_pb2.AdapterInfo(name=self.name, path=self.path, rank=self.rank, created=self.created)


class AdapterRegistry:
    def __init__(self, modules: list[tuple[str, str]] = ()):
        self.by_name: dict[str, Registered] = {}
        self.unchecked: dict[str, str] = dict(modules)      # start-time adapters not yet checked
        self._keys = itertools.count()
        self._checking = asyncio.Lock()

    def lookup(self, name: str) -> tuple[str, str] | None:
        """(key, path) of the adapter a request names; None if none is registered under that name."""
        reg = self.by_name.get(name)
        if reg is not None:
            return reg.key, reg.path
        path = self.unchecked.get(name)
        return None if path is None else (f"{name}@start", path)

    def listed(self) -> list[Registered]:
        return sorted(self.by_name.values(), key=lambda r: r.created)

    async def load(self, name: str, path: str, links: list) -> Registered:
        """Register `name` after one of `links` (live, serving adapters) checked the adapter at `path`."""
        if not NAME.fullmatch(name or ""):
            raise AdapterRefused(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: 1 to 128 letters, digits and "
                                 "._:/@+-, starting with a letter or digit")
        if not path or len(path) > MAX_PATH_CHARS:
            raise AdapterRefused(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: a path is required")
        if name in self.by_name or name in self.unchecked:
            raise AdapterRefused(grpc.StatusCode.ALREADY_EXISTS, f"the adapter {name!r} is already loaded")
        rank = await _check(name, path, links)
        if name in self.by_name:     # loaded by another call while this one waited for its check
            raise AdapterRefused(grpc.StatusCode.ALREADY_EXISTS, f"the adapter {name!r} is already loaded")
        reg = self.by_name[name] = Registered(name, f"{name}@{next(self._keys)}", path, rank, time.time())
        log.info("LoRA adapter %s loaded from %s (rank %d)", name, path, rank)
        return reg

    def unload(self, name: str) -> Registered:
        reg = self.by_name.pop(name, None)
        if reg is None:
            raise AdapterRefused(grpc.StatusCode.NOT_FOUND, f"the adapter {name!r} is not loaded")
        log.info("LoRA adapter %s unloaded", name)
        return reg

    def forget(self, key: str) -> str | None:
        """Unregister the adapter registered under `key`, if it still is; its name, or None."""
        for name, reg in list(self.by_name.items()):
            if reg.key == key:
                del self.by_name[name]
                return name
        return None

    async def check_start_modules(self, lora_links) -> None:
        """Check the start-time adapters on a connected executor that serves adapters (`lora_links()`; none: the
        next change of the fleet tries again)."""
        async with self._checking:
            for name, path in list(self.unchecked.items()):
                if not await self._check_start(name, path, lora_links()):
                    return

    async def _check_start(self, name: str, path: str, links: list) -> bool:
        """Whether the check of one start-time adapter came to an end (served, or dropped as unservable)."""
        try:
            rank = await _check(name, path, links)
        except AdapterRefused as e:
            if e.code != grpc.StatusCode.INVALID_ARGUMENT:
                return False     # no executor could say yet
            log.error("--lora-modules %s=%s cannot be served and is dropped: %s", name, path, e.message)
            del self.unchecked[name]
            return True
        del self.unchecked[name]
        # The start key stays: requests queued meanwhile already carry it.
        self.by_name[name] = Registered(name, f"{name}@start", path, rank, time.time())
        log.info("LoRA adapter %s (from --lora-modules) checked: rank %d", name, rank)
        return True

async def _check(name: str, path: str, links: list) -> int:
    if not links:
        raise AdapterRefused(grpc.StatusCode.FAILED_PRECONDITION, "no connected executor serves LoRA adapters "
                             "(start executors with --max-loras)")
    last = None
    for link in links:
        try:
            resp = await link.stub.CheckAdapter(executor_pb2.CheckAdapterRequest(name=name, path=path), timeout=60)
            return resp.rank
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise AdapterRefused(grpc.StatusCode.INVALID_ARGUMENT, e.details() or "the adapter was refused") \
                    from None
            last = e       # that executor is going away or busy: ask the next one
        except AttributeError:
            continue       # its stub went away meanwhile
    why = last.code().name if last is not None else "none reachable"
    raise AdapterRefused(grpc.StatusCode.UNAVAILABLE, f"no executor could check the adapter ({why})")
