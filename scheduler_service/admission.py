"""Admission: which executor takes a new request, and whether it may be queued at all.

Whatever arrives on the scheduler's port is checked here with the contract's rules, the same the gateway
applies, because the port is reachable by more than the gateway. The sampling message is queued as it
came and handed to the executor unchanged.
"""

from __future__ import annotations

import uuid

import grpc

from scheduler_service.executor_link import ExecutorLink
from scheduler_service.request import Request
from stepwire.contract import InvalidRequestError, check_prompt


class Refused(Exception):
    """A request that cannot be queued, with the status its caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def pick(links: list[ExecutorLink]) -> ExecutorLink | None:
    live = [lk for lk in links if lk.core is not None]
    if not live:
        return None
    # Fewest requests first; prefix-aware routing comes with the fleet.
    return min(live, key=lambda lk: len(lk.core.requests))


def admit(links: list[ExecutorLink], submit, max_waiting: int) -> tuple[ExecutorLink, str]:
    """Queue a SubmitRequest on an executor's core; raises Refused. Nothing changes when it is refused."""
    link = pick(links)
    if link is None:
        raise Refused(grpc.StatusCode.UNAVAILABLE, "no executor connected yet")
    core = link.core
    if len(core.waiting) >= max_waiting:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(core.waiting)} requests already waiting; retry later")
    rid = submit.request_id or f"req-{uuid.uuid4().hex[:12]}"
    try:
        if not submit.HasField("params"):
            raise InvalidRequestError("params", "sampling parameters are required")
        prompt = list(submit.prompt_token_ids)
        check_prompt(prompt, link.vocab_size, "prompt_token_ids")
        req = Request(rid, prompt, submit.params, eos_token_ids=link.eos_token_ids, priority=submit.priority,
                      cache_salt=submit.cache_salt or None)
        core.add_request(req)
    except InvalidRequestError as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    link.lifecycles.admitted(req, submit.traceparent, link.address)
    link.wakeup.set()
    return link, rid
