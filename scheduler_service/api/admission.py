"""Admission: whether a new request may be queued at all, and on which executor (the fleet's router).

Whatever arrives on the scheduler's port is checked here with the contract's rules, the same the gateway
applies, because the port is reachable by more than the gateway. The sampling message is queued as it
came and handed to the executor unchanged.
"""

from __future__ import annotations

import uuid

import grpc

from scheduler_service.core.request import Request
from scheduler_service.fleet.fleet import Fleet
from scheduler_service.fleet.tenant_limits import RateLimited
from stepwire.contract import InvalidRequestError, check_prompt
from stepwire.contract.limits import real


class Refused(Exception):
    """A request that cannot be queued, with the status its caller should see (and, when a tenant's limit
    refused it, which limit and when to retry)."""

    def __init__(self, code: grpc.StatusCode, message: str, rate_limited=None):
        super().__init__(message)
        self.code, self.message, self.rate_limited = code, message, rate_limited


def admit(fleet: Fleet, submit, max_waiting: int) -> str:
    """Queue a SubmitRequest on the executor the router picks, or as an orphan while none can take it;
    raises Refused, and then nothing has changed."""
    model = fleet.model()
    if model is None:
        raise Refused(grpc.StatusCode.UNAVAILABLE, "no executor connected yet")
    rid = submit.request_id or f"req-{uuid.uuid4().hex[:12]}"
    try:
        if not submit.HasField("params"):
            raise InvalidRequestError("params", "sampling parameters are required")
        prompt = list(submit.prompt_token_ids)
        check_prompt(prompt, model.vocab_size, "prompt_token_ids")
        lora = None
        if submit.adapter:
            lora = fleet.adapters.lookup(submit.adapter)
            if lora is None:
                raise Refused(grpc.StatusCode.NOT_FOUND, f"the model {submit.adapter!r} does not exist (no such "
                              "LoRA adapter is loaded)")
            if not fleet.lora_links() and fleet.live():
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "no connected executor serves LoRA adapters")
        if len(submit.tenant) > 128:
            raise InvalidRequestError("tenant", "at most 128 characters")
        weight = real("tenant_weight", submit.tenant_weight or 1.0, 0, 1000, above=True)
        req = Request(rid, prompt, submit.params, eos_token_ids=model.eos_token_ids, priority=submit.priority,
                      cache_salt=submit.cache_salt or None, lora=lora, tenant=submit.tenant, weight=weight)
        link, choice, source = fleet.route(req, pull=True)
        if link is not None:
            waiting = len(link.core.waiting)
            if waiting >= max_waiting:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{waiting} requests already waiting; retry later")
            link.check(req)
        # Last, so that a request refused for anything else costs its tenant nothing.
        fleet.limits.admit(req.tenant, submit.tenant_limits, rid,
                           len(prompt) + submit.params.max_tokens, submit.resumed)
        if link is None:
            fleet.lifecycles.admitted(req, submit.traceparent, "")
            fleet.wait_for_executor(req)
            return rid
    except InvalidRequestError as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    except RateLimited as e:
        m = fleet.lifecycles.metrics
        m.tenant_rejections.labels(m.tenant_label(submit.tenant), e.info.limit).inc()
        raise Refused(e.code, e.message, e.info) from None
    fleet.lifecycles.admitted(req, submit.traceparent, link.address)
    fleet.routed(link, req)
    pulled = source is not None and fleet.kv_moves.pull_prefix(req, source, link, choice)
    fleet.lifecycles.routed(rid, link.address, choice.hit, "new_prefix_pull" if pulled else "new")
    if not pulled:
        link.admit(req)      # checked above: it cannot be refused now
    return rid
