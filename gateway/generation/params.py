"""A generation's value types, as the front ends and the backend pass them: what a client asked beyond its
prompt, each delta of each completion, and the usage counted on the way."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.access.tenants import DEFAULT, Tenant
from stepwire.contract import SamplingParams

MAX_N = 16   # completions per request


@dataclass
class GenerationParams:
    """A client's request beyond its prompt: the sampling parameters the scheduler and the executor apply
    (sent on as they are), and what the gateway handles itself."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None   # None: whatever the context leaves after the prompt
    stop: list[str] = field(default_factory=list)
    n: int = 1
    priority: int = 0
    cache_salt: str | None = None
    adapter: str = ""               # a LoRA adapter's name; "": the served model
    tenant: Tenant = DEFAULT        # the API key's tenant (tenants.py): name, weight and limits


@dataclass
class Chunk:
    """One delta of one completion."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop: str | None = None
    logprobs: list | None = None   # per token: list of (token id, logprob), sampled first

    def then(self, later: Chunk) -> Chunk:
        """This delta and a later one of the same completion as one."""
        lps = None
        if self.logprobs is not None or later.logprobs is not None:
            lps = (self.logprobs or []) + (later.logprobs or [])
        return Chunk(self.index, self.text + later.text, self.token_ids + later.token_ids, later.finish_reason,
                     later.stop, lps)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
