"""What a generation request must satisfy before anything reaches the scheduler, for both client APIs: the
context length, every number against the width of the proto field it travels in, and what the caller's tenant
allows. Each failure is an InvalidRequestError naming the field (a 400, or INVALID_ARGUMENT)."""

from __future__ import annotations

from gateway.generation.params import MAX_N, GenerationParams
from stepwire.contract import InvalidRequestError, check_priority, check_prompt, check_stop
from stepwire.contract.sampling import MAX_LOGPROBS


def check_request(prompt_ids: list[int], p: GenerationParams, limit: int, vocab_size: int) -> None:
    """Validate before anything reaches the scheduler; raises InvalidRequestError naming the field.
    Every number is checked against the width of the proto field it travels in, so nothing can fail
    later, inside a conversion, where no one would answer the client. Resolves max_tokens."""
    # The length first: it costs nothing, and a list of a million ids need not be walked to refuse it.
    if limit and len(prompt_ids) >= limit:
        raise InvalidRequestError("prompt", f"this model's maximum context length is {limit} tokens; the "
                                            f"prompt has {len(prompt_ids)}")
    check_prompt(prompt_ids, vocab_size)
    if p.max_tokens is None:
        p.sampling.max_tokens = max(limit - len(prompt_ids), 1) if limit else 256
    else:
        p.sampling.max_tokens = p.max_tokens
        if limit and len(prompt_ids) + p.max_tokens > limit:
            raise InvalidRequestError("max_tokens", f"this model's maximum context length is {limit} tokens; "
                                                    f"{len(prompt_ids)} in the prompt plus max_tokens="
                                                    f"{p.max_tokens} exceed it")
    p.sampling.validate()
    check_params(p)
    check_tenant(len(prompt_ids), p)


def check_params(p: GenerationParams) -> None:
    """What can be checked without the prompt: the front ends call it before tokenizing, so a request
    that will be refused anyway costs no tokenizer time."""
    if not 1 <= p.n <= MAX_N:
        raise InvalidRequestError("n", f"must be in [1, {MAX_N}], got {p.n}")
    lp = p.sampling.logprobs
    if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
        raise InvalidRequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {lp}")
    if p.n > 1 and p.sampling.temperature == 0:
        raise InvalidRequestError("n", "n > 1 needs sampling (temperature > 0): greedy copies are identical")
    check_priority(p.priority)
    check_stop(p.stop)
    if p.cache_salt is not None:
        try:
            p.cache_salt.encode()
        except UnicodeEncodeError:
            raise InvalidRequestError("cache_salt", "not valid Unicode (it holds a lone surrogate)") from None


def check_tenant(prompt_tokens: int, p: GenerationParams) -> None:
    """What the caller's tenant allows, that the gateway can tell alone: its priority ceiling, and that the
    request fits its tokens per minute at all (one that never could would otherwise get 429s for ever)."""
    t = p.tenant
    if t.max_priority is not None and p.priority < t.max_priority:
        raise InvalidRequestError("priority", f"tenant {t.name!r} may ask priorities of {t.max_priority} and above "
                                  f"(lower is more urgent), got {p.priority}")
    # Each of n completions is a request of its own at the scheduler.
    for most, what in ((t.max_concurrent, "concurrent requests"), (t.requests_per_minute, "requests per minute")):
        if most and p.n > most:
            raise InvalidRequestError("n", f"n={p.n} completions exceed tenant {t.name!r}'s {most} {what}; it "
                                      "could never be served")
    cost = (prompt_tokens + p.sampling.max_tokens) * p.n
    if t.tokens_per_minute and cost > t.tokens_per_minute:
        raise InvalidRequestError("max_tokens", f"the prompt's {prompt_tokens} tokens plus max_tokens="
                                  f"{p.sampling.max_tokens} (times n={p.n}) exceed tenant {t.name!r}'s "
                                  f"{t.tokens_per_minute} tokens per minute; it could never be served")
