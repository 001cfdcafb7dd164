"""Sampling parameters: one schema, one set of rules, one conversion to the wire.

The gateway builds a `SamplingParams` from an HTTP body or a gRPC message and validates it; it crosses
to the scheduler as `stepwire.internal.SamplingParams`, and the scheduler hands that very message on to
the executor. `check_sampling` reads fields by name, so it validates the dataclass and the proto message
alike: the scheduler re-checks what arrives on its port with the same rules the gateway used.
Stop strings are matched by the gateway alone, so they are not in `SamplingParams`; `check_stop` is here so
that the HTTP and gRPC edges refuse the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stepwire.contract.errors import InvalidRequestError
from stepwire.contract.limits import FLOAT32_MAX, INT32_MAX, UINT32_MAX, UINT64_MAX, integer, real
from stepwire.internal import sampling_pb2

# OpenAI's own cap on stop strings. The length cap keeps the gateway's matcher cheap: it holds back (and
# searches) as much streamed text as the longest stop string is long.
MAX_STOP = 4
MAX_STOP_CHARS = 1024
# Each id travels to the executor in every new request and is compared against every sampled token.
MAX_STOP_TOKEN_IDS = 128


@dataclass(slots=True)
class SamplingParams:
    """Everything a request asks of generation. The scheduler reads the stop-related fields (max_tokens,
    min_tokens, stop_token_ids, ignore_eos); the executor's sampler reads the rest."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-n logprobs per sampled token
    # What the output must be (JSON schema, regex, choice, grammar, tool-call tags); None: unconstrained. The
    # wire message itself: it is passed on as is, and the executor compiles it (`structured/`).
    structured_output: sampling_pb2.StructuredOutput | None = None
    # The prompt's last n tokens are earlier output (a resubmission): a constrained request's matcher reads them.
    prior_output_tokens: int = 0
    # A reasoning model's end-of-reasoning marker and budget, when the executor must watch for it (a constraint
    # binds only the answer; a budget forces the end). None: the executor treats all output as the answer.
    reasoning: sampling_pb2.Reasoning | None = None

    def validate(self) -> SamplingParams:
        check_sampling(self)
        return self

    def to_proto(self) -> sampling_pb2.SamplingParams:
        msg = sampling_pb2.SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, prior_output_tokens=self.prior_output_tokens)
        if self.seed is not None:
            msg.seed = self.seed
        if self.logprobs is not None:
            msg.logprobs = self.logprobs
        if self.structured_output is not None:
            msg.structured_output.CopyFrom(self.structured_output)
        if self.reasoning is not None:
            msg.reasoning.CopyFrom(self.reasoning)
        return msg


MAX_LOGPROBS = 20   # top-n logprobs per token


def check_sampling(sp) -> None:
    """Raise InvalidRequestError naming the first bad field of a SamplingParams or its proto message."""
    integer("max_tokens", sp.max_tokens, 1, UINT32_MAX)
    real("temperature", sp.temperature, 0.0, FLOAT32_MAX)
    real("top_p", sp.top_p, 0.0, 1.0, above=True)
    integer("top_k", sp.top_k, -1, INT32_MAX)
    real("min_p", sp.min_p, 0.0, 1.0)
    if sp.seed is not None:
        integer("seed", sp.seed, 0, UINT64_MAX)
    integer("min_tokens", sp.min_tokens, 0, UINT32_MAX)
    if sp.min_tokens > sp.max_tokens:
        raise InvalidRequestError("min_tokens", f"must be at most max_tokens ({sp.max_tokens}), got {sp.min_tokens}")
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(sp.stop_token_ids)}")
    for tok in sp.stop_token_ids:
        integer("stop_token_ids", tok, 0, UINT32_MAX)
    if sp.logprobs is not None:
        # A cap, as vLLM's max_logprobs: 256 rows asking for the whole vocabulary would make one step's reply
        # larger than the message limit and break the executor's stream.
        integer("logprobs", sp.logprobs, 0, MAX_LOGPROBS)
    integer("prior_output_tokens", sp.prior_output_tokens, 0, UINT32_MAX)
    so = structured_of(sp)
    if so is not None:
        check_structured_size(so)
    reasoning = sp.reasoning if not isinstance(sp, sampling_pb2.SamplingParams) else \
        (sp.reasoning if sp.HasField("reasoning") else None)
    if reasoning is not None:
        if not 1 <= len(reasoning.end_token_ids) <= MAX_REASONING_END:
            raise InvalidRequestError("reasoning.end_token_ids", f"1 to {MAX_REASONING_END} token ids, got "
                                                                 f"{len(reasoning.end_token_ids)}")


# The end of a reasoning is a marker of a few tokens (`</think>`), never a text.
MAX_REASONING_END = 16


# A grammar crosses to the scheduler and the executor once per request and is compiled there; the cap keeps
# one request from making every hop hold (and every compile chew on) megabytes.
MAX_STRUCTURED_BYTES = 256 * 1024


def structured_of(sp) -> sampling_pb2.StructuredOutput | None:
    """The constraint of a SamplingParams or of its proto message; None when it is unconstrained."""
    if isinstance(sp, sampling_pb2.SamplingParams):
        return sp.structured_output if sp.HasField("structured_output") else None
    return getattr(sp, "structured_output", None)


def check_structured_size(so: sampling_pb2.StructuredOutput) -> None:
    """Exactly one kind, and small enough to carry; whether the library can compile it is checked where the
    tokenizer is (the gateway), not here."""
    if so.WhichOneof("kind") is None:
        raise InvalidRequestError("structured_output", "names no kind (json_schema, json_object, regex, choice, "
                                  "grammar or tags)")
    size = so.ByteSize()
    if size > MAX_STRUCTURED_BYTES:
        raise InvalidRequestError("structured_output", f"at most {MAX_STRUCTURED_BYTES} bytes, got {size}")


def check_stop(stop: Sequence[str]) -> None:
    """At most MAX_STOP stop strings, each at most MAX_STOP_CHARS characters of valid Unicode."""
    if len(stop) > MAX_STOP:
        raise InvalidRequestError("stop", f"at most {MAX_STOP} stop strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str):
            raise InvalidRequestError("stop", f"stop strings must be strings, got {type(s).__name__}")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequestError("stop", f"a stop string may be at most {MAX_STOP_CHARS} characters, got {len(s)}")
        try:
            s.encode()
        except UnicodeEncodeError:   # a lone surrogate, which JSON's \ud800 escapes can carry
            raise InvalidRequestError("stop", "a stop string is not valid Unicode") from None


def as_proto(sp) -> sampling_pb2.SamplingParams:
    """The wire form: a message that came off the wire is passed on as it is, never rebuilt."""
    return sp if isinstance(sp, sampling_pb2.SamplingParams) else sp.to_proto()
