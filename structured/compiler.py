"""Compile StructuredOutputs for one tokenizer: bounded in work and time, cached, never on the caller's thread.

A compiled grammar is an llguidance matcher in its start state; each request gets a `deep_copy` of it (cheap:
the grammar and its lexer are shared). The cache is one per tokenizer (`compiler_for`), keyed by the
StructuredOutput's serialized bytes, least recently used first out; refusals are cached too, so a bad grammar
sent again is refused without compiling again.

Compiling runs on the compiler's own threads (llguidance drops the GIL while it builds): the gateway's event
loop and the executor's step never wait on it beyond what they choose to. Work is bounded twice: llguidance's
parser limits make a grammar that is too large or too ambiguous fail by itself (deterministically), and a
compile that takes longer than `timeout_s` is refused and remembered as refused. A caller waits at most
WAIT_FACTOR times that (a compile may have queued behind another) before it is refused without the result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from collections import OrderedDict

import llguidance

from stepwire.contract import InvalidRequestError
from stepwire.internal import sampling_pb2
from structured.grammar import FIELD, grammar_of

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_CACHE_SIZE = 256
WAIT_FACTOR = 3
# llguidance's defaults, but short errors: verbose ones quote parser state and the grammar into the reply.
PARSER_LIMITS = dict(verbose_errors=False)


class Compiler:
    def __init__(self, tokenizer_json: str, vocab_size: int | None = None, eos_token_ids=(), *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache_size: int = DEFAULT_CACHE_SIZE, threads: int = 2):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_token = self.tokenizer.eos_token
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._done: OrderedDict[bytes, llguidance.LLMatcher | InvalidRequestError] = OrderedDict()
        self._running: dict[bytes, cf.Future] = {}
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")

    def submit(self, so: sampling_pb2.StructuredOutput) -> cf.Future:
        """A future of the start-state matcher for `so` (or of the InvalidRequestError refusing it), done at
        once on a cache hit; concurrent submits of one grammar share a compile."""
        key = so.SerializeToString(deterministic=True)
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                fut = cf.Future()
                fut.set_result(self._done[key])
                return fut
            if key in self._running:
                return self._running[key]
            so = sampling_pb2.StructuredOutput.FromString(key)
            fut = self._running[key] = self._pool.submit(self._compile, key, so)
            return fut

    def _compile(self, key: bytes, so: sampling_pb2.StructuredOutput):
        t0 = time.monotonic()
        try:
            grammar = grammar_of(so)
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                     limits=llguidance.LLParserLimits(**PARSER_LIMITS))
            out = InvalidRequestError(FIELD, f"{so.WhichOneof('kind')}: {_tidy(m.get_error())}") if m.is_error() else m
        except InvalidRequestError as e:
            out = e
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:   # noqa: BLE001 — the library's ValueErrors, even a Rust panic (a
            # BaseException in pyo3): the input's fault, never the process's end
            out = InvalidRequestError(FIELD, f"{so.WhichOneof('kind')}: {_tidy(str(e))}")
        if time.monotonic() - t0 > self.timeout_s:
            out = self._too_slow()
        with self._lock:
            self._running.pop(key, None)
            self._done[key] = out
            while len(self._done) > self.cache_size:
                self._done.popitem(last=False)
        return out

    def _too_slow(self) -> InvalidRequestError:
        return InvalidRequestError(FIELD, f"the grammar took longer than {self.timeout_s:g} s to compile; "
                                          "simplify it")

    def matcher(self, so: sampling_pb2.StructuredOutput, timeout_s: float | None = None) -> llguidance.LLMatcher:
        """A fresh matcher in the start state (blocks up to the time limit); InvalidRequestError if refused."""
        return _matcher_of(self.result(self.submit(so), timeout_s))

    def result(self, fut: cf.Future, timeout_s: float | None = None):
        try:
            return fut.result(self.timeout_s * WAIT_FACTOR if timeout_s is None else timeout_s)
        except cf.TimeoutError:
            return self._too_slow()

    def check(self, so: sampling_pb2.StructuredOutput) -> None:
        """Raise InvalidRequestError if `so` cannot be enforced with this tokenizer (blocks; see check_async)."""
        _refused(self.result(self.submit(so)))

    async def check_async(self, so: sampling_pb2.StructuredOutput) -> None:
        """`check` for an event loop: the compile runs on the compiler's threads, the loop goes on."""
        fut = self.submit(so)
        try:
            # Shielded: a timed-out wait must not cancel a compile other requests may share.
            out = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s * WAIT_FACTOR)
        except TimeoutError:
            out = self._too_slow()
        _refused(out)


def _refused(out) -> None:
    if isinstance(out, InvalidRequestError):
        raise out


def _matcher_of(out) -> llguidance.LLMatcher:
    _refused(out)
    return out.deep_copy()


def _tidy(message: str) -> str:
    """llguidance's errors span lines (a caret under the bad character): one line, bounded."""
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())[:300]


_compilers: dict[tuple, Compiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer_path: str, vocab_size: int | None = None, eos_token_ids=(),
                 timeout_s: float | None = None) -> Compiler:
    """The process's one Compiler (and so one cache) per tokenizer file, vocabulary width and EOS ids;
    `timeout_s` (the service's setting, given once at start-up) sets its time limit."""
    key = (str(tokenizer_path), vocab_size, tuple(eos_token_ids))
    with _compilers_lock:
        if key not in _compilers:
            with open(tokenizer_path) as f:
                _compilers[key] = Compiler(f.read(), vocab_size, eos_token_ids)
        if timeout_s is not None:
            _compilers[key].timeout_s = timeout_s
        return _compilers[key]
