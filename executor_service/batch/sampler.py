"""The executor's sampler: logits [N, V] -> one token per row, vectorized over the batch.

Greedy, temperature, top-k, top-p and min-p, with optional logprobs. Per-row parameters arrive as tensors
(the persistent batch keeps them as per-row arrays), so one step costs a handful of batched kernels whatever
the mix of requests. Random rows are sampled by the exponential race, argmax(probs / q) with q ~ Exp(1):
each row's noise is a plain [V] draw, so a seeded request draws its noise from its own generator and gets the
same tokens alone or in any batch, at any row.

In deterministic mode on the CPU (`Sampler(fixed=True)`) the softmax, the noise's log and the logprobs'
log_softmax are fixed_order.c's, whose sums and polynomials are the code's own, so a seeded token and its
logprobs are the same bits on every CPU; the rest (division by the temperature, sort, cumulative sum, masks,
argmax) is exact or sequential already.

The same code runs on CPU and CUDA (the device of the logits). Nothing here reads a tensor back to the host:
every decision that picks a code path is a Python flag computed when the parameters were built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch


class Maths(NamedTuple):
    """The reductions whose bits a library may choose: torch's, or fixed_order's (deterministic mode)."""

    softmax: object
    log: object
    log_softmax: object


TORCH = Maths(lambda x: x.softmax(dim=-1), torch.log, lambda x: x.log_softmax(dim=-1))


def fixed_maths() -> Maths:
    from executor_service.kernels import fixed_order
    return Maths(fixed_order.softmax, fixed_order.log, fixed_order.log_softmax)


# Temperatures below this are greedy: dividing by them would overflow, and they mean "argmax" anyway.
SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of a batch of N requests, on the sampler's device, plus batch-wide flags.

    The flags let the common batches skip whole passes over [N, V]: all greedy needs one argmax, and no
    top-k/top-p means no sort. They only look at the rows that sample randomly, since a greedy row's top-k
    or top-p cannot change its token. Build with `from_cpu` (or `from_lists`), which computes them on the host.
    """

    temperature: torch.Tensor  # [N] float32; < SAMPLING_EPS means greedy
    top_p: torch.Tensor  # [N] float32 in (0, 1]; 1 disables
    top_k: torch.Tensor  # [N] int64; <= 0 or >= vocab disables
    min_p: torch.Tensor  # [N] float32 in [0, 1]; 0 disables
    all_greedy: bool
    all_random: bool
    no_top_p: bool
    no_top_k: bool
    no_min_p: bool
    max_top_k: int  # largest enabled top-k among random rows (0 if none): the width of the top-k-only path
    max_num_logprobs: int | None  # most logprobs any row asked for; None if none did

    @classmethod
    def from_cpu(
        cls,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        top_k: torch.Tensor,
        min_p: torch.Tensor,
        *,
        vocab_size: int,
        device: torch.device | str,
        max_num_logprobs: int | None = None,
        non_blocking: bool = False,
    ) -> SamplingTensors:
        """Flags from host tensors of N rows (e.g. the first N rows of the persistent batch's pinned arrays),
        then one copy each to `device`. With non_blocking=True the host arrays must not be rewritten until
        the step that uses these tensors has run on the device."""
        greedy = temperature < SAMPLING_EPS
        rand = ~greedy
        top_k_on = rand & (top_k > 0) & (top_k < vocab_size)
        enabled_k = top_k[top_k_on]
        return cls(
            temperature=temperature.to(device, torch.float32, non_blocking=non_blocking),
            top_p=top_p.to(device, torch.float32, non_blocking=non_blocking),
            top_k=top_k.to(device, torch.int64, non_blocking=non_blocking),
            min_p=min_p.to(device, torch.float32, non_blocking=non_blocking),
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            no_top_p=not bool((rand & (top_p < 1.0)).any()),
            no_top_k=enabled_k.numel() == 0,
            no_min_p=not bool((rand & (min_p > 0.0)).any()),
            max_top_k=int(enabled_k.max()) if enabled_k.numel() else 0,
            max_num_logprobs=max_num_logprobs,
        )

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_p: Sequence[float],
        top_k: Sequence[int],
        min_p: Sequence[float],
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        logprobs: Sequence[int | None] | None = None,
    ) -> SamplingTensors:
        """Convenience for tests and small callers: one value per row in Python lists."""
        wanted = [n for n in (logprobs or ()) if n is not None]
        return cls.from_cpu(
            torch.tensor(temperature, dtype=torch.float32),
            torch.tensor(top_p, dtype=torch.float32),
            torch.tensor(top_k, dtype=torch.int64),
            torch.tensor(min_p, dtype=torch.float32),
            vocab_size=vocab_size,
            device=device,
            max_num_logprobs=max(wanted) if wanted else None,
        )


class LogprobsTensors(NamedTuple):
    """Column 0 is the sampled token, columns 1..n the top-n tokens by logprob, descending (vLLM's layout)."""

    token_ids: torch.Tensor  # [N, n + 1] int64
    logprobs: torch.Tensor  # [N, n + 1] float32


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None


class Sampler:
    """Stateless: all per-request state (parameters, seeded generators) is passed in on each call. `fixed`:
    deterministic mode's softmax and log (fixed_order.c), CPU only."""

    def __init__(self, fixed: bool = False):
        self.maths = fixed_maths() if fixed else TORCH

    def __call__(
        self,
        logits: torch.Tensor,
        st: SamplingTensors,
        generators: dict[int, torch.Generator],
        num_logprobs: int | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [N, V]. `generators` maps a row index to that row's request's
        generator (seeded requests only; on the logits' device); it advances the generators it uses.
        `num_logprobs` (normally st.max_num_logprobs) asks for the top-n logprobs of the raw logits."""
        # The caller's logits are never written to: the first op on the random path makes a new tensor.
        logits = logits.float()
        if st.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            sampled = _sample_random(logits, st, generators, self.maths)
            # Greedy rows take the argmax of the raw logits, not of the processed ones.
            greedy = st.temperature < SAMPLING_EPS
            token_ids = sampled if st.all_random else torch.where(greedy, logits.argmax(dim=-1), sampled)
        lp = None if num_logprobs is None else compute_logprobs(logits, token_ids, num_logprobs, self.maths)
        return SamplerOutput(token_ids=token_ids, logprobs=lp)


def _sample_random(logits: torch.Tensor, st: SamplingTensors, generators: dict[int, torch.Generator],
                   maths: Maths = TORCH) -> torch.Tensor:
    # Greedy rows ride along with temperature 1 (their result is discarded) so nothing divides by zero.
    temp = torch.where(st.temperature < SAMPLING_EPS, 1.0, st.temperature)
    logits = logits / temp.unsqueeze(1)  # a fresh tensor: everything below may work in place
    if not st.no_min_p:
        logits = apply_min_p(logits, st.min_p, maths)
    if not (st.no_top_k and st.no_top_p):
        vocab = logits.shape[-1]
        k = None if st.no_top_k else normalize_top_k(st.top_k, vocab)
        p = None if st.no_top_p else st.top_p
        if p is None:
            logits = apply_top_k_only(logits, k, st.max_top_k)
        else:
            logits = apply_top_k_top_p(logits, k, p, maths)
    return exponential_race(maths.softmax(logits), generators, maths)


def normalize_top_k(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """Disabled top-k (<= 0, or >= vocab which keeps everything anyway) becomes exactly `vocab`."""
    return torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, maths: Maths = TORCH) -> torch.Tensor:
    """Keep tokens with p_i >= min_p * p_max (in place). Since p_i / p_max = exp(l_i - l_max) this is the
    same test on logits, l_i >= l_max + log(min_p), and needs no softmax. min_p = 0 gives log 0 = -inf:
    nothing is masked; min_p = 1 keeps only the max."""
    thresh = logits.amax(dim=-1, keepdim=True) + maths.log(min_p).unsqueeze(1)
    return logits.masked_fill_(logits < thresh, float("-inf"))


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k without a full sort: topk(max_top_k) gives each row its k-th largest value as a threshold.

    Same mask as the sort path (values below the k-th largest are dropped, ties with it kept), so a row's
    token does not depend on which path its batch took. `k` is normalized (disabled rows hold vocab).
    max_top_k covers the random rows only; a greedy row asking for more is left unmasked, as its token is
    the raw argmax anyway."""
    disabled = k > max_top_k
    # Those rows would index past max_top_k: point them at column 0 and drop their threshold below.
    idx = (k.masked_fill(disabled, 1) - 1).unsqueeze(1)
    thresh = logits.topk(max_top_k, dim=-1).values.gather(1, idx)
    thresh.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < thresh, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                      maths: Maths = TORCH) -> torch.Tensor:
    """Top-k then top-p with one ascending sort (in place on `logits`, which is returned).

    Ascending order puts the small tail first, so its cumulative sum is accurate in float32 and top-p is
    "drop the tokens whose cumulative mass from the bottom is <= 1 - p". The top token is always kept.
    Rows with k = vocab and p = 1 come back unchanged (up to tokens whose probability is exactly 0)."""
    vocab = logits.shape[-1]
    # Stable: tied logits keep their vocabulary order, so which of them top-p drops is not the sort's choice.
    sorted_logits, order = logits.sort(dim=-1, stable=True)
    if k is not None:
        # The k-th largest sits at ascending position vocab - k; k = vocab keeps everything.
        thresh = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < thresh, float("-inf"))
    if p is not None:
        cum = maths.softmax(sorted_logits).cumsum_(dim=-1)
        drop = cum <= (1.0 - p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    # Back to vocabulary order: the race must see a row's noise at the same token positions whether or not
    # its batch needed a sort, or a seeded row's tokens would depend on its neighbours' parameters.
    return logits.scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator], maths: Maths = TORCH
                     ) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1) i.i.d., picks token i with probability probs[i] (in place on probs).

    Unseeded rows share one batched draw from the default generator; each seeded row then overwrites its
    own row from its own generator, so its noise is independent of the batch and of its row index."""
    u = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        u.uniform_()
    for row, gen in generators.items():
        u[row].uniform_(generator=gen)
    # q = -log(u) is Exp(1); written out because CPU's exponential_() is ~5x slower than uniform_ + log.
    # uniform_ gives u in [0, 1), so q > 0 and a masked token (p = 0) scores exactly 0: it never wins.
    # The floor keeps q finite: u = 0 would give q = inf and zero out a row whose only allowed token drew it.
    q = maths.log(u.clamp_min_(torch.finfo(u.dtype).tiny)).neg_()
    return probs.div_(q).argmax(dim=-1)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int, maths: Maths = TORCH) -> LogprobsTensors:
    """Raw logprobs (log_softmax of the unprocessed logits, vLLM's default): the sampled token's own in
    column 0, then the top-n descending."""
    logprobs = maths.log_softmax(logits)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))
    n = min(n, logprobs.shape[-1])
    if n == 0:
        return LogprobsTensors(token_ids.unsqueeze(1), sampled)
    top_vals, top_ids = logprobs.topk(n, dim=-1)
    return LogprobsTensors(torch.cat([token_ids.unsqueeze(1), top_ids], 1), torch.cat([sampled, top_vals], 1))
