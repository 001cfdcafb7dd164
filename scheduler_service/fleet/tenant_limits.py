"""Per-tenant limits, counted here for every gateway at once: requests and tokens per minute, concurrent requests.

Gateways are stateless and many. Each one stamps a request with its tenant's limits from the tenants file (every
replica reads the same Secret), and the scheduler, the one service that sees every request, counts them. So a
limit holds across replicas, and restarting a gateway forgets nothing. Restarting the scheduler starts the windows
afresh. Its gateways resubmit what they held, marked `resumed`: those count towards concurrency, not again
towards the per-minute limits, and no limit refuses them (they were admitted once already).

The per-minute limits are sliding windows of `window` seconds (60 in service). A request costs one request and
its prompt plus max_tokens in tokens, counted when it is admitted, as OpenAI counts them; when it ends, its charge
comes down to the tokens it used (prompt plus output), so a request that stops early (an EOS, a stop string, a
client gone) leaves the rest of its max_tokens to the tenant's next requests. Concurrency counts the
requests admitted and not yet ended (Lifecycles calls `ended`). A refusal says which limit refused it, what is left
of both per-minute limits, and when the request would fit: the gateway answers 429 with Retry-After and OpenAI's
x-ratelimit-* headers from it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from stepwire.internal import scheduler_pb2

WINDOW_SECONDS = 60.0
CONCURRENT_RETRY_SECONDS = 1.0     # no way to know when a running request ends; a client retries after this


class RateLimited(Exception):
    """A tenant's limit refused a request: `info` is what the gateway needs for its 429."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, info: scheduler_pb2.RateLimited):
        super().__init__(message)
        self.message, self.info = message, info


@dataclass
class _Usage:
    requests: deque = field(default_factory=deque)           # admission times in the window
    tokens: deque = field(default_factory=deque)             # [admission time, tokens]: lowered when it ends
    token_sum: int = 0
    live: set = field(default_factory=set)                   # request ids admitted, not ended


class TenantLimits:
    def __init__(self, window: float = WINDOW_SECONDS, clock=time.monotonic):
        self.window, self.clock = window, clock
        self.usage: dict[str, _Usage] = {}
        self.tenant_of: dict[str, str] = {}                   # live request id -> its tenant
        self.charge_of: dict[str, list] = {}                  # live request id -> its entry in `tokens`

    def admit(self, tenant: str, limits: scheduler_pb2.TenantLimits, rid: str, tokens: int, resumed: bool) -> None:
        """Count a request against its tenant's limits, or raise RateLimited and count nothing."""
        rpm, tpm, most = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent
        if not (rpm or tpm or most):
            return
        now = self.clock()
        u = self.usage.setdefault(tenant, _Usage())
        self._expire(u, now)
        # A resumed request was admitted once already (its client may have tokens of it): refusing it now would
        # turn a restart clients must not notice into an error. It counts, and the next new request waits for it.
        if most and not resumed and len(u.live) >= most:
            self._refuse(u, limits, now, "concurrent", most, 0, CONCURRENT_RETRY_SECONDS,
                         f"{len(u.live)} of its {most} concurrent requests are running")
        if not resumed:
            if rpm and len(u.requests) >= rpm:
                wait = u.requests[len(u.requests) - rpm] + self.window - now
                self._refuse(u, limits, now, "requests", rpm, 0, wait, f"{rpm} requests per minute")
            if tpm and u.token_sum + tokens > tpm:
                self._refuse(u, limits, now, "tokens", tpm, tpm - u.token_sum, self._tokens_wait(u, tokens, tpm, now),
                             f"{tpm} tokens per minute ({tokens} asked, {tpm - u.token_sum} left)")
            if rpm:
                u.requests.append(now)
            if tpm:
                u.tokens.append(entry := [now, tokens])
                u.token_sum += tokens
                self.charge_of[rid] = entry
        u.live.add(rid)
        self.tenant_of[rid] = tenant

    def ended(self, rid: str, used_tokens: int | None = None) -> None:
        """`rid` ended having used `used_tokens` (prompt plus output; None: unknown, the charge stands)."""
        tenant = self.tenant_of.pop(rid, None)
        entry = self.charge_of.pop(rid, None)
        if tenant is not None:
            u = self.usage[tenant]
            u.live.discard(rid)
            if entry is not None and used_tokens is not None and used_tokens < entry[1]:
                # Still in the window (an expired entry was zeroed): give back what it did not use.
                u.token_sum -= entry[1] - used_tokens
                entry[1] = used_tokens
            if not (u.live or u.requests or u.tokens):
                del self.usage[tenant]

    def _expire(self, u: _Usage, now: float) -> None:
        edge = now - self.window
        while u.requests and u.requests[0] <= edge:
            u.requests.popleft()
        while u.tokens and u.tokens[0][0] <= edge:
            entry = u.tokens.popleft()
            u.token_sum -= entry[1]
            entry[1] = 0

    def _tokens_wait(self, u: _Usage, tokens: int, tpm: int, now: float) -> float:
        """Seconds until enough of the window's tokens have expired for `tokens` more to fit."""
        need = u.token_sum + tokens - tpm
        for at, n in u.tokens:
            need -= n
            if need <= 0:
                return at + self.window - now
        return self.window

    def _refuse(self, u: _Usage, limits, now: float, which: str, value: int, remaining: int, wait: float,
                what: str):
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        info = scheduler_pb2.RateLimited(
            limit=which, limit_value=value, remaining=max(remaining, 0), retry_after_seconds=max(wait, 0.0),
            requests_limit=rpm, requests_remaining=max(rpm - len(u.requests), 0),
            requests_reset_seconds=(u.requests[0] + self.window - now) if rpm and u.requests else 0.0,
            tokens_limit=tpm, tokens_remaining=max(tpm - u.token_sum, 0),
            tokens_reset_seconds=(u.tokens[0][0] + self.window - now) if tpm and u.tokens else 0.0)
        raise RateLimited(f"rate limit reached: {what}; retry in {max(wait, 0.0):.1f} s", info)
