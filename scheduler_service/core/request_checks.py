"""What a new request must satisfy before a scheduler core queues it.

Checked in full before anything changes, so a refused request leaves no trace: no queue entry, no blocks.
"""

from __future__ import annotations

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request, RequestStatus
from stepwire.contract import InvalidRequestError, check_sampling


def check_new_request(request: Request, config: SchedulerConfig, num_blocks: int, known: dict) -> None:
    """Raise InvalidRequestError naming the bad field. `known` holds the core's unfinished requests."""
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    if rid in known:
        raise InvalidRequestError("request_id", f"duplicate request id {rid!r}")
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequestError("prompt_token_ids", "prompt must not be empty")
    if not all(type(t) is int and t >= 0 for t in prompt):
        raise InvalidRequestError("prompt_token_ids", "token ids must be integers >= 0")
    if len(prompt) >= config.max_model_len:
        raise InvalidRequestError(
            "prompt_token_ids",
            f"prompt has {len(prompt)} tokens; with at least one output token it cannot fit "
            f"max_model_len={config.max_model_len}")
    check_sampling(request.sampling_params)
    # The last step computes every token but the final sampled one; a request whose worst case cannot
    # fit the whole pool would be preempted and resumed forever, so it is refused now.
    capacity = (num_blocks - 1) * config.block_size
    worst = min(len(prompt) + request.sampling_params.max_tokens, config.max_model_len) - 1
    if worst > capacity:
        field = "prompt_token_ids" if len(prompt) > capacity else "max_tokens"
        raise InvalidRequestError(
            field, f"prompt ({len(prompt)} tokens) plus max_tokens ({request.sampling_params.max_tokens}) "
                   f"needs KV for {worst} tokens; this executor's cache holds {capacity}")
    if isinstance(request.priority, bool) or not isinstance(request.priority, int):
        raise InvalidRequestError("priority", "must be an integer")
    if request.status != RequestStatus.WAITING or request.num_computed_tokens or request.num_output_tokens:
        raise InvalidRequestError("request_id", f"request {rid!r} was already scheduled elsewhere")
