"""A limited tenant's stream starts only at its first token (so that a refusal is a 429): a client that hangs up
before that, while its request waits for a slot, ends the request, which frees its place in the tenant's
concurrency, instead of leaving it to run to the end for nobody."""

from __future__ import annotations

import asyncio

from starlette.authentication import AuthCredentials

from gateway.access.auth import TenantUser
from gateway.access.tenants import Tenant
from gateway.generation.params import GenerationParams
from gateway.generation.telemetry import GatewayMetrics, Observation
from gateway.http_api.responses import respond


class QueuedForever:
    """A backend whose one request never gets its first token; it records whether the request was ended."""

    max_model_len = 256
    model_name = "m"

    def __init__(self):
        self.started = asyncio.Event()
        self.ended = False
        self.unannounced: set[str] = set()
        self.asked_to_abort = False

    def check(self, prompt, p):
        pass

    async def generate(self, prompt, p, usage, obs=None, request_id=None, resume_context=None):
        self.started.set()
        try:
            await asyncio.Event().wait()
            yield None
        finally:
            self.ended = True      # the real backend cancels its completions here: an abort at the scheduler
            # ... and not a detach, which would keep a request its client never had the id of
            self.asked_to_abort = request_id in self.unannounced


class Raw:
    def __init__(self, tenant: Tenant):
        self.scope = {"user": TenantUser(tenant), "auth": AuthCredentials(["authenticated"])}
        self.gone = False

    async def is_disconnected(self) -> bool:
        return self.gone


class Body:
    stream = True
    stream_options = None


def run(tenant: Tenant) -> tuple[int | None, bool]:
    async def go():
        backend, raw = QueuedForever(), Raw(tenant)
        obs = Observation(GatewayMetrics(), "http", "/v1/completions", "text_completion", {}, "m")
        answer = asyncio.ensure_future(respond(backend, raw, Body(), [1, 2, 3], GenerationParams(tenant=tenant),
                                               False, obs))
        await backend.started.wait()
        raw.gone = True
        response = await asyncio.wait_for(answer, 5)
        return response.status_code, backend.ended and backend.asked_to_abort

    return asyncio.run(go())


def test_a_limited_tenant_s_client_that_hangs_up_before_its_first_token_ends_its_request():
    status, ended = run(Tenant("team", max_concurrent=1))
    assert status == 499 and ended
