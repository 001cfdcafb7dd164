"""The executor's sampler: greedy, temperature, top-k, top-p, min-p, seeds and logprobs."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402

from executor_service.batch.sampler import (  # noqa: E402
    Sampler,
    SamplingTensors,
    apply_top_k_only,
    apply_top_k_top_p,
    normalize_top_k,
)

sampler = Sampler()


def tensors(n: int, vocab: int, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, **kw) -> SamplingTensors:
    """SamplingTensors for n rows; each knob is one value for all rows or a list of n."""

    def rows(v):
        return list(v) if isinstance(v, list | tuple) else [v] * n

    return SamplingTensors.from_lists(rows(temperature), rows(top_p), rows(top_k), rows(min_p), vocab_size=vocab, **kw)


def flat_logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Nearly uniform logits: a random sample almost never hits the argmax, so a greedy bug shows."""
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 0.1


def gens(seeds: dict[int, int]) -> dict[int, torch.Generator]:
    return {row: torch.Generator().manual_seed(s) for row, s in seeds.items()}


# ---------------------------------------------------------------- greedy


def test_all_greedy_rows_return_argmax():
    logits = flat_logits(16, 1000)
    out = sampler(logits, tensors(16, 1000, temperature=0.0), {})
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_return_argmax_of_the_raw_logits():
    n, vocab = 12, 1000
    logits = flat_logits(n, vocab, seed=1)
    greedy_rows = [0, 3, 4, 9]
    temperature = [0.0 if i in greedy_rows else 5.0 for i in range(n)]
    # Greedy rows carry knobs that would change a random row's token; they must not matter.
    top_k = [3 if i == 3 else 50 if i % 2 else -1 for i in range(n)]
    top_p = [0.2 if i == 4 else 0.9 if i % 3 == 0 else 1.0 for i in range(n)]
    min_p = [0.5 if i == 9 else 0.0 for i in range(n)]
    st = tensors(n, vocab, temperature, top_p, top_k, min_p)
    assert not st.all_greedy and not st.all_random
    torch.manual_seed(0)
    out = sampler(logits, st, gens({3: 7, 5: 8})).token_ids
    argmax = logits.argmax(-1)
    assert torch.equal(out[greedy_rows], argmax[greedy_rows])
    random_rows = [i for i in range(n) if i not in greedy_rows]
    assert not torch.equal(out[random_rows], argmax[random_rows])  # the random rows really sampled


def test_tiny_temperature_is_greedy():
    logits = flat_logits(8, 500, seed=2)
    out = sampler(logits, tensors(8, 500, temperature=1e-6), {})
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize(
    "knob",
    [
        {"top_k": 1},
        {"top_p": 1e-6},
        {"top_p": 1e-9},  # 1 - p rounds to 1.0 in float32: only the always-keep-the-top rule saves the row
        {"min_p": 1.0},
        {"top_k": 1, "top_p": 0.95},
    ],
    ids=["top_k_1", "top_p_tiny", "top_p_below_float32_eps", "min_p_1", "top_k_1_with_top_p"],
)
@pytest.mark.parametrize("neighbour_forces_sort", [False, True])
def test_knobs_that_keep_one_token_equal_greedy(knob, neighbour_forces_sort):
    n, vocab = 32, 800
    logits = flat_logits(n, vocab, seed=3)
    cols = {k: [v] * n for k, v in knob.items()}
    if neighbour_forces_sort:
        # Row 0 asks for top-p, so the whole batch takes the sort path rather than the top-k-only one.
        cols.setdefault("top_p", [1.0] * n)
        cols["top_p"][0] = 0.5
    st = tensors(n, vocab, temperature=3.0, **cols)
    assert st.all_random
    for step in range(5):
        out = sampler(logits, st, gens({r: 100 * step + r for r in range(0, n, 2)})).token_ids
        rows = list(range(1, n)) if neighbour_forces_sort else list(range(n))
        assert torch.equal(out[rows], logits.argmax(-1)[rows])


# ---------------------------------------------------------------- allowed sets

# A known distribution over 12 tokens: 0.30, 0.25, 0.20, 0.10, then 0.15 spread over 8 tokens.
PROBS = [0.30, 0.25, 0.20, 0.10] + [0.15 / 8] * 8
# The tokens are shuffled into the vocabulary so that "allowed" is never simply "the first few ids".
PERM = [7, 2, 11, 0, 5, 9, 1, 3, 4, 6, 8, 10]
KNOWN_LOGITS = torch.empty(12)
KNOWN_LOGITS[PERM] = torch.tensor(PROBS).log()
A, B, C, D = PERM[:4]


@pytest.mark.parametrize(
    ("knob", "allowed"),
    [
        ({"top_k": 3}, {A, B, C}),
        ({"top_k": 4, "temperature": 5.0}, {A, B, C, D}),  # top-k does not care about temperature
        ({"top_p": 0.5}, {A, B}),  # 0.30 + 0.25 >= 0.5
        ({"top_p": 0.3}, {A}),  # the top token alone already covers 0.3
        ({"top_p": 0.76}, {A, B, C, D}),  # 0.75 is not enough
        ({"min_p": 0.5}, {A, B, C}),  # p >= 0.15
        ({"min_p": 0.8}, {A, B}),  # p >= 0.24
        ({"top_k": 3, "top_p": 0.5}, {A, B}),
        ({"top_k": 2, "min_p": 0.1, "top_p": 0.9}, {A, B}),
    ],
)
def test_filters_never_sample_outside_the_allowed_set(knob, allowed):
    n, vocab = 64, 12
    st = tensors(n, vocab, **knob)
    logits = KNOWN_LOGITS.expand(n, vocab).clone()
    seen = set()
    for step in range(8):  # 512 draws, half of them from per-row seeded generators
        torch.manual_seed(step)
        tokens = sampler(logits, st, gens({r: 1000 * step + r for r in range(0, n, 2)})).token_ids
        seen |= set(tokens.tolist())
    assert seen <= allowed
    assert seen == allowed  # and the filter keeps every allowed token reachable


def test_top_k_only_path_masks_exactly_like_the_sort_path():
    g = torch.Generator().manual_seed(4)
    vocab = 40
    logits = torch.randint(-5, 5, (16, vocab), generator=g).float()  # plenty of ties at the k-th value
    k = normalize_top_k(torch.tensor([-1, 0, 1, 2, 3, 5, 8, 13, 21, 34, 39, 40, 41, 100, 7, 1]), vocab)
    max_k = int(k[k < vocab].max())
    fast = apply_top_k_only(logits.clone(), k, max_k)
    sort = apply_top_k_top_p(logits.clone(), k, None)
    assert torch.equal(fast, sort)
    kept = torch.isfinite(fast).sum(-1)
    assert torch.all(kept >= torch.clamp(k, max=vocab))  # at least k survive (more only on ties)
    assert torch.equal(kept[k == vocab], torch.full_like(kept[k == vocab], vocab))


def test_greedy_row_with_a_wider_top_k_than_any_random_row_does_not_break_the_top_k_only_path():
    # max_top_k only counts random rows, so the top-k-only path must not index a greedy row's larger k.
    logits = flat_logits(3, 50, seed=9)
    st = tensors(3, 50, temperature=[1.0, 0.0, 0.0], top_k=[1, 30, 49])
    assert st.no_top_p and not st.no_top_k and st.max_top_k == 1
    assert torch.equal(sampler(logits, st, {}).token_ids, logits.argmax(-1))


# ---------------------------------------------------------------- distributions


def reference_probs(logits: list[float], temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> list[float]:
    """The target distribution written out plainly: temperature, min-p, top-k, top-p, renormalize."""
    z = [x / temperature for x in logits]
    m = max(z)
    p = [math.exp(x - m) for x in z]
    s = sum(p)
    p = [x / s for x in p]
    keep = {i for i, x in enumerate(p) if x >= min_p * max(p)}
    order = sorted(keep, key=lambda i: -p[i])
    if 0 < top_k < len(p):
        order = order[:top_k]
    mass = sum(p[i] for i in order)
    nucleus, acc = [], 0.0
    for i in order:
        nucleus.append(i)
        acc += p[i] / mass
        if acc >= top_p:
            break
    total = sum(p[i] for i in nucleus)
    return [p[i] / total if i in nucleus else 0.0 for i in range(len(p))]


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


DIST_LOGITS = [1.5, 0.8, 0.3, 0.0, -0.4, -1.0, -1.7, -2.5]


@pytest.mark.parametrize(
    "knob",
    [
        {"temperature": 0.6},
        {"temperature": 1.7},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 0.9, "top_p": 0.8},
        {"temperature": 1.5, "min_p": 0.2},
    ],
)
@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_distribution_matches_the_filtered_softmax(knob, seeded):
    n, vocab, calls = 2000, len(DIST_LOGITS), 5
    logits = torch.tensor(DIST_LOGITS).expand(n, vocab).clone()
    st = tensors(n, vocab, **knob)
    counts = torch.zeros(vocab, dtype=torch.int64)
    torch.manual_seed(11)
    for c in range(calls):
        g = gens({r: c * n + r for r in range(n)}) if seeded else {}
        counts += torch.bincount(sampler(logits, st, g).token_ids, minlength=vocab)
    expected = reference_probs(DIST_LOGITS, **knob)
    for i, p in enumerate(expected):
        if p == 0:
            assert counts[i] == 0, f"token {i} is filtered out but was sampled"
    # 7 degrees of freedom at most: P(chi2 > 30) < 1e-4. Fixed seeds keep this deterministic.
    assert chi_square(counts.tolist(), expected) < 30
    # The bound has power: the unfiltered T=1 softmax is far outside it.
    assert chi_square(counts.tolist(), reference_probs(DIST_LOGITS)) > 100


# ---------------------------------------------------------------- seeds


def step_logits(step: int, n: int, vocab: int) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(10_000 + step))


SEEDED_KNOBS = [
    {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0},  # alone: no sort at all
    {"temperature": 0.8, "top_p": 0.9, "top_k": -1, "min_p": 0.0},  # alone: sort path
    {"temperature": 1.2, "top_p": 1.0, "top_k": 20, "min_p": 0.05},  # alone: top-k-only path
]


@pytest.mark.parametrize("knob", SEEDED_KNOBS, ids=["plain", "top_p", "top_k_min_p"])
def test_seeded_request_gets_the_same_tokens_alone_and_in_any_batch(knob):
    vocab, steps, seed = 64, 20, 1234
    # Alone: row 0 of a batch of one.
    gen = torch.Generator().manual_seed(seed)
    st = tensors(1, vocab, **{k: [v] for k, v in knob.items()})
    alone = [sampler(step_logits(s, 1, vocab), st, {0: gen}).token_ids.item() for s in range(steps)]
    assert len(set(alone)) > 3  # really random, so a mix-up would show

    # In a batch of 8 at row 5, beside greedy, unseeded and other seeded rows with other knobs.
    row = 5
    temperature = [0.0, 1.0, 0.7, 0.0, 2.0, knob["temperature"], 1.0, 0.5]
    top_p = [1.0, 0.5, 1.0, 0.3, 0.95, knob["top_p"], 1.0, 0.8]
    top_k = [-1, -1, 3, 5, 10, knob["top_k"], vocab + 3, 0]
    min_p = [0.0, 0.0, 0.1, 0.0, 0.3, knob["min_p"], 0.0, 0.2]
    st8 = tensors(8, vocab, temperature, top_p, top_k, min_p)
    assert not st8.no_top_p and not st8.no_min_p and not st8.no_top_k
    gen = torch.Generator().manual_seed(seed)
    others = gens({2: 99, 7: 5})
    batched = []
    for s in range(steps):
        logits = step_logits(1000 + s, 8, vocab)  # the neighbours see other logits every step
        logits[row] = step_logits(s, 1, vocab)[0]
        batched.append(sampler(logits, st8, {row: gen, **others}).token_ids[row].item())
    assert batched == alone


def test_same_seed_in_two_generators_repeats_and_different_seeds_differ():
    vocab, steps = 200, 20
    st = tensors(1, vocab, temperature=1.0)

    def run(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sampler(step_logits(s, 1, vocab), st, {0: gen}).token_ids.item() for s in range(steps)]

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c


def test_seeded_generators_persist_across_steps():
    # Reusing one generator object must advance it: step 2 is not a replay of step 1.
    vocab = 1000
    st = tensors(1, vocab)
    logits = flat_logits(1, vocab, seed=5)
    gen = torch.Generator().manual_seed(3)
    tokens = [sampler(logits, st, {0: gen}).token_ids.item() for _ in range(10)]
    assert len(set(tokens)) > 5


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("n_lp", [0, 1, 5])
def test_logprobs_hold_the_sampled_token_then_the_raw_top_n(n_lp):
    n, vocab = 6, 50
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(6)) * 3
    st = tensors(n, vocab, temperature=[0.0, 0.5, 2.0, 1.0, 0.0, 1.5], top_k=[-1, 5, -1, 3, -1, -1])
    torch.manual_seed(1)
    out = sampler(logits, st, {}, num_logprobs=n_lp)
    ids, lps = out.logprobs
    assert ids.shape == lps.shape == (n, n_lp + 1)
    raw = torch.log_softmax(logits, dim=-1)  # before temperature and filters
    assert torch.equal(ids[:, 0], out.token_ids)
    torch.testing.assert_close(lps[:, 0], raw.gather(1, out.token_ids[:, None])[:, 0])
    top_vals, top_ids = raw.topk(n_lp, dim=-1)
    assert torch.equal(ids[:, 1:], top_ids)
    torch.testing.assert_close(lps[:, 1:], top_vals)
    assert torch.all(lps[:, 1:-1] >= lps[:, 2:])  # descending
    assert torch.all(lps <= 0)


def test_no_logprobs_unless_asked_and_caller_logits_untouched():
    logits = flat_logits(4, 30, seed=8)
    before = logits.clone()
    out = sampler(logits, tensors(4, 30, temperature=[0.0, 1.0, 0.7, 1.0], top_p=0.5, min_p=0.1, top_k=4), {})
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_empty_batch_and_bfloat16_logits():
    out = sampler(torch.empty(0, 30), tensors(0, 30), {}, num_logprobs=2)
    assert out.token_ids.shape == (0,) and out.logprobs.token_ids.shape == (0, 3)
    logits = flat_logits(4, 30, seed=10).bfloat16()  # what a CUDA model in bf16 hands over
    out = sampler(logits, tensors(4, 30, temperature=[0.0, 1.0, 0.0, 0.5], top_p=0.5), gens({1: 1}), num_logprobs=1)
    assert out.token_ids.dtype == torch.int64 and out.logprobs.logprobs.dtype == torch.float32
    assert torch.equal(out.token_ids[[0, 2]], logits.argmax(-1)[[0, 2]])


# ---------------------------------------------------------------- flags


def test_flags_ignore_disabled_knobs_and_greedy_rows():
    st = tensors(3, 100, temperature=[0.0, 1.0, 1.0], top_k=[5, 100, -1], top_p=[0.5, 1.0, 1.0], min_p=[0.3, 0, 0])
    assert (st.all_greedy, st.all_random) == (False, False)
    assert st.no_top_k and st.no_top_p and st.no_min_p  # k >= vocab is off; row 0's knobs cannot matter
    st = tensors(2, 100, temperature=[1.0, 0.5], top_k=[7, 99], logprobs=[None, 3])
    assert st.all_random and not st.no_top_k and st.max_top_k == 99 and st.max_num_logprobs == 3
    assert tensors(2, 100, temperature=0.0).all_greedy


# ---------------------------------------------------------------- properties

row_knobs = hs.tuples(
    hs.sampled_from([0.0, 1e-6, 0.3, 1.0, 2.5]),  # temperature
    hs.sampled_from([1e-4, 0.3, 0.9, 1.0]),  # top_p
    hs.sampled_from([-1, 0, 1, 2, 5, 1000]),  # top_k (1000 >= any vocab here)
    hs.sampled_from([0.0, 0.2, 1.0]),  # min_p
    hs.one_of(hs.none(), hs.integers(0, 2**31)),  # seed
)


@settings(max_examples=150, deadline=None)
@given(
    rows=hs.lists(row_knobs, min_size=1, max_size=6),
    vocab=hs.integers(1, 40),
    data_seed=hs.integers(0, 2**31),
    n_lp=hs.one_of(hs.none(), hs.integers(0, 4)),
)
def test_random_mixed_batches_stay_in_vocab_skip_banned_tokens_and_keep_greedy_argmax(rows, vocab, data_seed, n_lp):
    n = len(rows)
    g = torch.Generator().manual_seed(data_seed)
    logits = torch.randint(-3, 3, (n, vocab), generator=g).float()  # small ints: many ties
    banned = torch.rand(n, vocab, generator=g) < 0.3
    banned[torch.arange(n), torch.randint(0, vocab, (n,), generator=g)] = False  # keep one token per row
    logits[banned] = float("-inf")
    temperature, top_p, top_k, min_p, seeds = (list(c) for c in zip(*rows, strict=True))
    st = tensors(n, vocab, temperature, top_p, top_k, min_p)
    generators = gens({r: s for r, s in enumerate(seeds) if s is not None})
    out = sampler(logits, st, generators, num_logprobs=n_lp)
    tok = out.token_ids
    assert tok.shape == (n,) and tok.dtype == torch.int64
    assert torch.all((tok >= 0) & (tok < vocab))
    assert not banned[torch.arange(n), tok].any()
    greedy = torch.tensor(temperature) < 1e-5
    assert torch.equal(tok[greedy], logits.argmax(-1)[greedy])
    if n_lp is not None:
        assert out.logprobs.token_ids.shape == (n, min(n_lp, vocab) + 1)
        assert torch.equal(out.logprobs.token_ids[:, 0], tok)
