"""Which slice of the model one tensor-parallel rank holds.

Attention is split by KV head, and each rank takes the query heads that share its KV heads, so GQA groups
never straddle two ranks and a rank's cache holds only its own heads. The MLP's intermediate dimension is
split the same way, so each block needs one all-reduce after its output projection and one after `down`.
Neither split must be even: SmolLM2-135M has 3 KV heads, and at TP=2 rank 0 gets one and rank 1 two (rank 0
also answers the step, so it takes the smaller share). The vocabulary is split in equal padded slices: the
embedding looks up only its rows, and the LM head computes only its columns of the logits, which rank 0
gathers to sample. Embedding and LM head are the largest matrices of a small model, and a tied pair stays
tied because both are cut at the same rows.

Deterministic mode (`exact`) cannot sum partial products across ranks: a sum over two halves of a dot
product rounds differently from the single-rank GEMM's sum over the whole, so the tokens would depend on the
degree. There o and down are split by their output columns instead (`hidden`), each rank computes whole dot
products over an input gathered from every rank, and the outputs are gathered again: every number any rank
computes is one a single rank computes too, and gathers move numbers without adding them.
"""

from __future__ import annotations

from dataclasses import dataclass

from executor_service.model.config import ModelConfig, ModelLoadError


def _cut(total: int, size: int, rank: int) -> tuple[int, int]:
    """Contiguous [lo, hi) of `total` for `rank` of `size`; earlier ranks get the smaller share."""
    return total * rank // size, total * (rank + 1) // size


@dataclass(frozen=True)
class Partition:
    rank: int
    size: int
    kv_heads: tuple[int, int]        # [lo, hi) of the model's KV heads
    q_heads: tuple[int, int]         # [lo, hi) of its query heads: the groups of those KV heads
    intermediate: tuple[int, int]    # [lo, hi) of the MLP's intermediate dimension
    vocab: tuple[int, int]           # [lo, hi) of the vocabulary
    vocab_rows: int                  # rows of this rank's embedding and LM head: every rank's slice, padded
    max_kv_heads: int                # the most KV heads any rank holds: all ranks size their caches by it
    hidden: tuple[int, int] = (0, 0)  # [lo, hi) of the hidden dimension: o's and down's output when exact
    exact: bool = False              # deterministic mode: o and down split by output, their inputs gathered

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1, exact: bool = False) -> Partition:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a tensor-parallel group of {size}")
        if cfg.num_kv_heads < size:
            raise ModelLoadError(f"{cfg.path}: --tensor-parallel-size {size} needs at least {size} KV heads to "
                                 f"split; the model has {cfg.num_kv_heads}")
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelLoadError(f"{cfg.path}: {cfg.num_heads} attention heads do not form groups over "
                                 f"{cfg.num_kv_heads} KV heads")
        group = cfg.num_heads // cfg.num_kv_heads
        kv = _cut(cfg.num_kv_heads, size, rank)
        per = -(-cfg.vocab_size // size)
        return cls(rank=rank, size=size, kv_heads=kv, q_heads=(kv[0] * group, kv[1] * group),
                   intermediate=_cut(cfg.intermediate_size, size, rank),
                   vocab=(min(rank * per, cfg.vocab_size), min((rank + 1) * per, cfg.vocab_size)),
                   vocab_rows=per,
                   max_kv_heads=max(b - a for a, b in (_cut(cfg.num_kv_heads, size, r) for r in range(size))),
                   hidden=_cut(cfg.hidden_size, size, rank), exact=exact)

    @property
    def gathers(self) -> bool:
        """Whether o and down gather their inputs and outputs (exact, and more than one rank) rather than sum."""
        return self.exact and self.size > 1

    def widths(self, cfg: ModelConfig, what: str) -> list[int]:
        """Every rank's width of a gathered activation, in rank order: "q" (attention output), "ff" (the MLP's
        intermediate) or "hidden"."""
        parts = [Partition.of(cfg, r, self.size) for r in range(self.size)]
        if what == "q":
            return [p.num_heads * cfg.head_dim for p in parts]
        field = {"ff": "intermediate", "hidden": "hidden"}[what]
        return [getattr(p, field)[1] - getattr(p, field)[0] for p in parts]

    def full_rows(self, cfg: ModelConfig) -> dict[str, tuple[tuple[int, int], list[int]]]:
        """For each column-split matrix: the single-rank matrix's shape, and which of its rows this rank holds
        (in its own order). Deterministic mode checks at start-up that its slice computes those rows' bits."""
        d, h, i = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        qr = range(self.q_heads[0] * d, self.q_heads[1] * d)
        kvr = range(self.kv_heads[0] * d, self.kv_heads[1] * d)
        ff = range(*self.intermediate)
        out = {"qkv_proj": ((q + 2 * kv, h), [*qr, *(q + r for r in kvr), *(q + kv + r for r in kvr)]),
               "gate_up_proj": ((2 * i, h), [*ff, *(i + r for r in ff)]),
               "lm_head": ((cfg.vocab_size, h), list(range(*self.vocab)))}
        if self.gathers or self.size == 1:
            out["o_proj"] = ((h, q), list(range(*self.hidden)))
            out["down_proj"] = ((h, i), list(range(*self.hidden)))
        return out

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]
