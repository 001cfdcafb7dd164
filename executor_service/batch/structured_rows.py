"""Constrained rows: each one's grammar matcher, its token mask every step, its advance by the sampled token.

A matcher is built when a row enters this executor (new, moved here, resent after a scheduler restart) from
the row's own tokens: the compiled grammar (cached per tokenizer, `structured/`), advanced over the output
tokens the row already holds. So the executor keeps nothing a restart would lose, and a request that moves
goes on exactly where it was. A preempted row keeps its matcher while it is parked here; its tokens do not
change meanwhile.

Each step the masks are filled on a thread of their own while the forward pass runs (llguidance drops the
GIL), then applied to the logits in one masked fill: disallowed tokens get -inf, so every sampling mode,
greedy included, picks an allowed one, and logprobs are those of the masked distribution (as vLLM reports
them). A step with no constrained row allocates and waits for nothing.

Only rank 0 samples, so only rank 0 holds matchers. A grammar this executor cannot compile (the gateway
checked it, so this means a scheduler that skipped that check, or a mismatched library) is refused for that
row alone: its mask allows only EOS, so it ends at once; nothing else is disturbed.

A row of a reasoning model (`SamplingParams.reasoning`) thinks first: its tokens are free until it writes the
end-of-reasoning marker, and its grammar binds only what follows (the answer), from the token after the marker.
A reasoning budget forces the marker, token by token, once the reasoning has that many tokens. The row's phase,
like its matcher, follows from its own output tokens, so a moved or resent row is where it was.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from pathlib import Path

import numpy as np
import torch

from observability.log_limits import Every
from stepwire.contract import InvalidRequestError
from structured import compiler_for

log = logging.getLogger("stepwire.executor")


def watched(sp) -> bool:
    """Whether a row's tokens must be watched on the host as it samples: a grammar, or a reasoning budget."""
    return sp.HasField("structured_output") or (sp.HasField("reasoning") and sp.reasoning.HasField("budget"))


class Thinking:
    """Where a row stands in its reasoning: `tail` counts the marker's first tokens its output ends with."""

    __slots__ = ("end", "budget", "count", "tail", "done")

    def __init__(self, end: tuple[int, ...], budget: int | None):
        self.end, self.budget = end, budget
        self.count = self.tail = 0     # reasoning tokens so far (the marker's included)
        self.done = False

    def copy(self) -> Thinking:
        t = Thinking(self.end, self.budget)
        t.count, t.tail, t.done = self.count, self.tail, self.done
        return t

    def consume(self, token: int) -> bool:
        """Take one output token; False once the reasoning is over (the token belongs to the answer)."""
        if self.done:
            return False
        seen = (*self.end[:self.tail], token)
        self.tail = next(k for k in range(min(len(seen), len(self.end)), -1, -1)
                         if seen[len(seen) - k:] == self.end[:k])
        self.count += 1
        self.done = self.tail == len(self.end)
        return True

    def forced(self) -> int | None:
        """The marker's next token once the budget is spent (a marker begun on its own is finished too)."""
        if self.done or self.budget is None or self.count - self.tail < self.budget:
            return None
        return self.end[self.tail]

    def after(self, ahead) -> tuple[str, int | None]:
        """The phase after the proposals `ahead`: ("free", None), ("forced", token), or ("answer", n), the last
        n of `ahead` being answer tokens."""
        t = self if self.done or not len(ahead) else self.copy()
        for i, tok in enumerate(ahead):
            if not t.consume(tok):
                return "answer", len(ahead) - i
        if t.done:
            return "answer", 0
        token = t.forced()
        return ("free", None) if token is None else ("forced", token)


class RowGrammar:
    """One request's matcher, or the reason it has none. `pending` are tokens to consume once compiled. With a
    reasoning phase (`thinking`), only the tokens after it reach the matcher; a row with a budget and no grammar
    has no future."""

    __slots__ = ("future", "matcher", "pending", "refused", "thinking")

    def __init__(self, future: cf.Future | None, pending: list[int], refused: str | None = None,
                 thinking: Thinking | None = None):
        self.future, self.matcher, self.pending, self.refused = future, None, pending, refused
        self.thinking = thinking

    def ready(self, compiler) -> bool:
        """Compiled and caught up with the row's tokens (waits for the compile); False if refused."""
        if self.future is None:
            return False
        if self.refused is None and self.matcher is None:
            out = compiler.result(self.future)
            if isinstance(out, InvalidRequestError):
                self.refused = str(out)
            else:
                m = out.deep_copy()
                if not m.consume_tokens(self.pending):
                    self.refused = f"its output tokens do not follow its grammar ({m.get_error()[:200]})"
                self.matcher, self.pending = m, []
        return self.refused is None and not self.matcher.is_error()

    def binds(self) -> bool:
        """Whether its samples may be masked at all: not a budget's row whose reasoning is over."""
        return self.future is not None or self.refused is not None or \
            (self.thinking is not None and not self.thinking.done)

    def advance(self, token: int) -> None:
        if self.thinking is not None and self.thinking.consume(token):
            return
        if self.future is None:
            return
        if self.matcher is None:
            self.pending.append(token)   # an answer begun before the compile finished
        # After the grammar ended (EOS sampled), a step already in flight may sample once more: ignored.
        elif self.refused is None and not self.matcher.is_stopped():
            self.matcher.consume_token(token)


class StructuredRows:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device):
        self.tokenizer_path = Path(model_dir) / "tokenizer.json"
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self._compiler = None
        self._threads = cf.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._refusals = Every()
        self.last_fill_seconds: float | None = None   # the last step's mask filling (benchmarks read it)

    @property
    def compiler(self):
        if self._compiler is None:   # the first constrained request pays for the tokenizer, once
            self._compiler = compiler_for(str(self.tokenizer_path), self.vocab_size, self.eos_token_ids)
        return self._compiler

    def admit(self, state, output_tokens: np.ndarray) -> None:
        """Give a row entering the batch its matcher-to-be: the compile starts now, off this thread."""
        sp = state.sampling_params
        tokens, thinking = output_tokens.tolist(), None
        if sp.HasField("reasoning"):
            thinking = Thinking(tuple(sp.reasoning.end_token_ids),
                                sp.reasoning.budget if sp.reasoning.HasField("budget") else None)
            if not thinking.end or max(thinking.end) >= self.vocab_size:
                state.grammar = RowGrammar(None, [], "its end-of-reasoning tokens are not in the vocabulary")
                return
            tokens = tokens[sum(thinking.consume(t) for t in tokens):]
        if not sp.HasField("structured_output"):
            state.grammar = RowGrammar(None, [], thinking=thinking)
        elif not self.tokenizer_path.exists():
            state.grammar = RowGrammar(None, [], "the model directory has no tokenizer.json")
        else:
            state.grammar = RowGrammar(self.compiler.submit(sp.structured_output), tokens, thinking=thinking)

    def start(self, states: list, drafts: list | None = None) -> cf.Future | None:
        """Begin filling the masks of the constrained rows among `states` (the step's sampling positions, in
        order); None, at no cost, when none is constrained. With speculation a request samples several
        positions: `drafts` gives, per position, the proposals before it (its mask is the grammar's state
        after them)."""
        at = [i for i, s in enumerate(states) if s.grammar is not None and s.grammar.binds()]
        self.last_fill_seconds = None
        if not at:
            return None
        return self._threads.submit(self._masks, at, [states[i].grammar for i in at],
                                    [states[i].handle for i in at], None if drafts is None else [drafts[i] for i in at])

    def _masks(self, at: list[int], grammars: list[RowGrammar], handles: list[int], drafts: list | None):
        import llguidance.numpy as lln
        t0 = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        bits = np.zeros((len(at), words), dtype=np.int32)
        for k, g in enumerate(grammars):
            ahead = drafts[k] if drafts is not None else ()
            if g.thinking is not None and g.refused is None:
                phase, arg = g.thinking.after(ahead)
                if phase == "free" or (phase == "answer" and g.future is None):
                    bits[k] = -1            # reasoning, or an answer no grammar binds: every token allowed,
                    if phase == "free" and g.future is not None:
                        self._no_eos(bits[k])   # but the end, while a grammar's answer has not been written
                    continue
                if phase == "forced":       # the budget is spent: the marker's next token, and nothing else
                    bits[k] = 0
                    bits[k].view(np.uint32)[arg // 32] = np.uint32(1 << (arg % 32))
                    continue
                ahead = ahead[len(ahead) - arg:]
            ready = g.ready(self.compiler)
            if ready:
                # Proposals the grammar refuses stop the walk: positions past one are never kept anyway.
                moved = g.matcher.try_consume_tokens(list(ahead)) if len(ahead) else 0
                lln.fill_next_token_bitmask(g.matcher, bits, k)
                if moved:
                    g.matcher.rollback(moved)
            if not ready or not bits[k].any():
                self._only_eos(bits[k], handles[k], g)
        # Inverted before unpacking: the step thread gets the disallowed tokens as a bool tensor, ready to fill.
        banned = np.unpackbits(np.invert(bits.view(np.uint8)), axis=1, bitorder="little")[:, :self.vocab_size]
        self.last_fill_seconds = time.perf_counter() - t0
        return at, torch.from_numpy(banned).view(torch.bool)

    def _only_eos(self, row: np.ndarray, handle: int, g: RowGrammar) -> None:
        if g.refused is not None and self._refusals.ready() is not None:
            log.warning("request %d: structured output refused (%s); it ends at once", handle, g.refused)
        words = row.view(np.uint32)
        words[:] = 0
        for eos in self._eos_ids():
            words[eos // 32] |= np.uint32(1 << (eos % 32))

    def _no_eos(self, row: np.ndarray) -> None:
        words = row.view(np.uint32)
        for eos in self._eos_ids():
            words[eos // 32] &= ~np.uint32(1 << (eos % 32))

    def _eos_ids(self) -> tuple[int, ...]:
        return self.eos_token_ids or (self.compiler.eos_token,)

    def apply(self, logits: torch.Tensor, pending: cf.Future) -> None:
        """Mask the logits of the constrained rows in place (waits for the masks)."""
        at, banned = pending.result()
        banned = banned.to(logits.device, non_blocking=True)
        if len(at) == logits.shape[0]:   # every sampling row is constrained: no gather, no scatter
            logits.masked_fill_(banned, float("-inf"))
            return
        idx = torch.tensor(at, device=logits.device)
        logits[idx] = logits[idx].masked_fill_(banned, float("-inf"))

    def advance(self, states: list, sampled: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Each constrained row consumes its kept tokens: one each, or `counts[i]` (speculation)."""
        at = 0
        for i, s in enumerate(states):
            n = 1 if counts is None else int(counts[i])
            if s.grammar is not None:
                for tok in sampled[at:at + n].tolist():
                    s.grammar.advance(tok)
            at += n

    @staticmethod
    def allowed_prefix(state, tokens: np.ndarray) -> np.ndarray:
        """The longest prefix of proposed `tokens` a constrained row's grammar accepts from where it stands;
        none while its grammar is still compiling (a proposal must never wait for it)."""
        g = state.grammar
        if g.thinking is not None and not g.thinking.done and g.refused is None:
            return tokens   # free while reasoning: each position's mask follows the proposals before it
        if g.future is None and g.refused is None:
            return tokens
        if g.refused is not None or g.matcher is None or g.pending or g.matcher.is_stopped():
            return tokens[:0]
        return tokens[:g.matcher.validate_tokens(tokens.tolist())]
