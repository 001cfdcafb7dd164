"""Stored responses for the Responses API's `previous_response_id`: the conversation a response ended, kept
where every gateway finds it, for the tenant that made it.

The scheduler keeps them because it is the one place all gateways share (a gateway replica's memory would
strand a conversation on the replica that happened to serve its first turn). Each entry is opaque bytes from a
gateway; the store bounds their age (`ttl_seconds`) and their total size (`max_bytes`, the oldest leaving
first), and answers a lookup only for the tenant that stored it, so an id is no key to another team's
conversation. A scheduler restart loses them, as it loses kept streams.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Entry:
    tenant: str
    model: str
    conversation: bytes
    stored_at: float


class ResponseStore:
    def __init__(self, ttl_seconds: float, max_bytes: int, clock=time.monotonic):
        self.ttl, self.max_bytes, self.clock = ttl_seconds, max_bytes, clock
        self._entries: OrderedDict[str, Entry] = OrderedDict()      # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, tenant: str, model: str, conversation: bytes) -> bool:
        """Keep it (replacing one of the same id); False if it alone is over the byte budget."""
        if len(conversation) > self.max_bytes:
            return False
        self._drop(response_id)
        self._entries[response_id] = Entry(tenant, model, conversation, self.clock())
        self.bytes += len(conversation)
        self._expire()
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str, tenant: str) -> Entry | None:
        self._expire()
        e = self._entries.get(response_id)
        return e if e is not None and e.tenant == tenant else None

    def _expire(self) -> None:
        horizon = self.clock() - self.ttl
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.stored_at > horizon:
                return
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        e = self._entries.pop(response_id, None)
        if e is not None:
            self.bytes -= len(e.conversation)
