"""When a request stops: a step's sampled tokens appended one by one, each checked against the stop rules.

EOS and stop ids are checked before length, as vLLM does, so a request ending both ways has "stopped". A
step may carry several tokens for a row (a resumed row's parked token, later speculation's accepted ones);
whatever follows the token that ends the request is cut, with its logprobs.
"""

from __future__ import annotations

from scheduler_service.core.request import Request, RequestStatus

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED


def append_sampled(req: Request, tokens: list[int], lps, hash_block_size: int):
    """Append `tokens` to the request until one ends it. Returns (the tokens kept, their logprobs, the finished
    status or None). With `hash_block_size` (prefix caching on), each block the tokens fill is hashed as it
    fills, so a later request can hit it."""
    all_ids = req.all_token_ids
    for k, tok in enumerate(tokens):
        all_ids.append(tok)
        num_tokens = len(all_ids)
        if hash_block_size and num_tokens % hash_block_size == 0:
            req.update_block_hashes(hash_block_size)
        if tok in req.stop_ids and num_tokens >= req.min_stop_len:
            finish = _STOPPED
        elif num_tokens >= req.length_limit:
            finish = _LENGTH
        else:
            continue
        if k + 1 < len(tokens):
            tokens = tokens[:k + 1]
            if lps is not None:
                lps = lps[:k + 1]
        return tokens, lps, finish
    return tokens, lps, None
