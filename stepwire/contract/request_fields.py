"""Checks of a request's fields other than sampling, shared by the edges that receive them."""

from __future__ import annotations

from collections.abc import Sequence

from stepwire.contract.errors import InvalidRequestError
from stepwire.contract.limits import INT32_MAX, INT32_MIN, integer


def check_priority(priority) -> int:
    return integer("priority", priority, INT32_MIN, INT32_MAX)


def check_prompt(token_ids: Sequence[int], vocab_size: int, field: str = "prompt") -> None:
    """A non-empty list of ids the model knows: anything else would index outside its embedding table."""
    if not token_ids:
        raise InvalidRequestError(field, "the prompt is empty")
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequestError(field, f"token ids must be integers in [0, {vocab_size}), got {t!r}")


# The chat roles OpenAI's API accepts; a template given any other would render something the model never saw.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_chat(messages: Sequence[dict]) -> None:
    """At least one message, each with a known role: the same rule for HTTP bodies and gRPC messages."""
    if not messages:
        raise InvalidRequestError("messages", "at least one message is required")
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role",
                                      f"must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}")
