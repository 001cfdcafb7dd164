"""The gateway's journal of its in-flight requests: what it needs to resubmit one after losing the scheduler.

The scheduler is the one stateful service, and a restart (a crash, a node drain, a rollout) forgets every
request it held. The gateway owns its clients' streams, so it keeps, per request, exactly what a
resubmission needs: the prompt ids, the sampling parameters with the seed, the tokens already delivered
to the client, and the detokenizer and stop-string state that turned them into text. Resubmitted with
prompt plus delivered tokens as its prompt and the rest of max_tokens, a request goes on from the next
token: greedy decoding is deterministic, and a seeded request draws each token from the seed and the
token's position (the executor's `draw_seed`), so it samples what it would have sampled anyway. The client
sees no repeated and no missing token.

Each gateway keeps its own journal; a request is resubmitted by the gateway that owns its client.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gateway.access.tenants import DEFAULT, Tenant
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stops import StopMatcher
from stepwire.contract import SamplingParams
from stepwire.internal import scheduler_pb2


@dataclass
class Entry:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams         # as the client asked (the seed already made unique per completion)
    priority: int
    cache_salt: str
    traceparent: str
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher
    delivered: list[int] = field(default_factory=list)
    submissions: int = 0
    adapter: str = ""                # its LoRA adapter, by name ("": the base model)
    tenant: Tenant = DEFAULT         # whose it is: its weight in fair sharing and its limits
    resume_context: bytes | None = None   # a stream its client may resume: how to answer it (resumed.py)

    def submit_request(self) -> scheduler_pb2.SubmitRequest:
        """The request as the scheduler must see it now: prompt plus delivered tokens, the rest of max_tokens
        and min_tokens. Each submission has its own id, so a scheduler that still knows an older one (a
        graceful shutdown racing a resubmission) never sees a duplicate; except a resumable one's, whose id is
        what its client resumes by: the gateway first asks the scheduler for it by that id (backend.py), and
        submits it again only where the scheduler does not hold it. Resubmitted, it stays resumable, and the
        scheduler's record of it starts with the delivered tokens (prior_output_tokens of the prompt's end)."""
        n = len(self.delivered)
        sp = self.sampling
        if n:
            sp = replace(sp, max_tokens=sp.max_tokens - n, min_tokens=max(sp.min_tokens - n, 0),
                         prior_output_tokens=sp.prior_output_tokens + n)
        rid = self.request_id if not self.submissions or self.resumable else f"{self.request_id}~{self.submissions}"
        resumed = self.submissions > 0
        self.submissions += 1
        t = self.tenant
        limits = scheduler_pb2.TenantLimits(requests_per_minute=t.requests_per_minute,
                                            tokens_per_minute=t.tokens_per_minute, max_concurrent=t.max_concurrent)
        return scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=self.prompt_ids + self.delivered,
                                           params=sp.to_proto(), priority=self.priority, cache_salt=self.cache_salt,
                                           traceparent=self.traceparent, adapter=self.adapter, tenant=t.name,
                                           tenant_weight=t.weight, tenant_limits=limits, resumed=resumed,
                                           resumable=self.resumable, resume_context=self.resume_context or b"")

    @property
    def resumable(self) -> bool:
        return self.resume_context is not None


class Journal:
    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def add(self, entry: Entry) -> Entry:
        self.entries[entry.request_id] = entry
        return entry

    def remove(self, entry: Entry) -> None:
        self.entries.pop(entry.request_id, None)

    def __len__(self) -> int:
        return len(self.entries)
