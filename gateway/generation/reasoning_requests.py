"""What a chat request asks of a model that reasons (docs/reasoning.md): where its output starts, and what the
executor must know so that a constraint binds only the answer and a budget ends the reasoning.

The executor learns the phase from the row's own tokens, so it has to see the reasoning open: a request that
needs it (a constraint, a budget) to a template that leaves the model to open the block itself (Qwen3's) gets the
opening marker at the end of its prompt, the words the model would write first. A template that closed the block
in the prompt (thinking switched off) leaves nothing to watch: a constraint then binds from the first token.
"""

from __future__ import annotations

from gateway.generation.chat_output import ReasoningPlan
from gateway.text.reasoning import END, START, opens_inside
from stepwire.contract import InvalidRequestError
from stepwire.internal import sampling_pb2

# Enough of the prompt's end to hold an opening marker and the blank lines a template writes after it.
TAIL_TOKENS = 16


# The reasoning efforts OpenAI's APIs take. "none" is no reasoning at all (the end of the block is forced at
# once); the others leave its length to the model.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def effort_budget(effort: str | None) -> int | None:
    return 0 if effort == "none" else None


def check_budget(budget, field: str) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget < 2 ** 32:
        raise InvalidRequestError(field, f"a number of tokens, 0 or more, got {str(budget)[:40]}")
    return budget


def plan_reasoning(tokenizer, prompt: list[int], constrained: bool, budget: int | None, field: str,
                   strict: bool = True) -> tuple[list[int], ReasoningPlan | None, sampling_pb2.Reasoning | None]:
    """(the prompt to send, how to read the output, what the executor must watch). `budget` is the request's cap
    on reasoning tokens, named `field` in its API. A model that does not reason refuses a cap (`strict`), or
    ignores it where clients send it to every model (Anthropic's `thinking`)."""
    if not tokenizer.reasoning:
        if budget is not None and strict:
            raise InvalidRequestError(field, "this model does not reason (its template writes no <think> block; "
                                             "see --reasoning-parser)")
        return prompt, None, None
    tail = tokenizer.decode(prompt[-TAIL_TOKENS:], skip_special_tokens=False)
    inside = opens_inside(tail)
    watched = constrained or budget is not None
    if watched and not inside and not tail.rstrip().endswith(END):
        prompt = prompt + tokenizer.encode(START + "\n", add_special_tokens=False)
        inside = True
    wire = None
    if watched and inside:
        wire = sampling_pb2.Reasoning(end_token_ids=tokenizer.encode(END, add_special_tokens=False), budget=budget)
    return prompt, ReasoningPlan(inside), wire
