"""What both client APIs share: validation, tokenization, the call to the scheduler, detokenization,
stop strings, n completions, usage. The gRPC and HTTP front ends only translate shapes."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc

from gateway.generation.adapter_names import AdapterNames, ModelNotFound
from gateway.generation.journal import Entry, Journal
from gateway.generation.params import Chunk, GenerationParams, Usage
from gateway.generation.request_checks import check_params, check_request
from gateway.generation.scheduler_session import SchedulerError, SchedulerSession, SessionLost, output_error, take_over
from gateway.generation.telemetry import GatewayMetrics, Observation
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stops import StopMatcher
from gateway.text.tokenizer import ChatTemplateError, ModelTokenizer
from stepwire.contract import (
    InvalidRequestError,
    check_chat,
    check_prompt,
)
from stepwire.contract.limits import UINT64_MAX
from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("stepwire.gateway")
# Tokenizing and rendering chat templates run here, off the event loop: one large prompt must not stall
# every other stream's deltas. Few threads: the work is CPU-bound and the body size limit bounds each job.
TOKENIZER_THREADS = 2
# What a client whose request outlived --scheduler-wait-seconds without a scheduler gets (HTTP 503, or an SSE
# error event once the stream has started; gRPC UNAVAILABLE).
SCHEDULER_GONE = "the scheduler did not come back within {:g}s; retry"


class Backend:
    """The gateway's view of the scheduler: validated, tokenized requests in, text deltas out."""

    def __init__(self, channel: grpc.aio.Channel, tokenizer: ModelTokenizer, model_name: str,
                 metrics: GatewayMetrics | None = None, scheduler_wait_seconds: float = 60.0,
                 expect_model: str = ""):
        self.use_channel(channel)
        self.tokenizer = tokenizer
        self.model_name = model_name
        # With several models (served_models.py): the model directory name this one's scheduler must serve, and
        # why it does not (a models file that pairs the name with another model's scheduler), "" while it does.
        self.expect_model = expect_model
        # Until its scheduler has named its model, none is confirmed: a request then would reach whatever model the
        # file's address leads to.
        self.wrong_model = f"the scheduler for {model_name!r} has not said yet which model it serves" \
            if expect_model else ""
        self.max_model_len = 0   # learned from the scheduler once it is connected
        self._serving = asyncio.Event()   # set while the scheduler serves (see `ready`)
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self.journal = Journal()
        self.metrics = metrics
        self.scheduler_wait_seconds = scheduler_wait_seconds
        self.adapters = AdapterNames()
        # Resumable streams whose client has not had their first event, so cannot resume them: one ended now is
        # aborted at the scheduler, not kept for a resume that cannot come.
        self.unannounced: set[str] = set()

    @property
    def ready(self) -> bool:
        """The scheduler is serving (kept by gateway.server.follow_scheduler); held requests wait for it."""
        return self._serving.is_set()

    @ready.setter
    def ready(self, ok: bool) -> None:
        if ok:
            self._serving.set()
        else:
            self._serving.clear()

    def use_channel(self, channel: grpc.aio.Channel) -> grpc.aio.Channel | None:
        """Talk to the scheduler over `channel` from now on (mTLS or plaintext); returns the one it replaces."""
        old = getattr(self, "channel", None)
        self.channel = channel
        self.stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self.session = SchedulerSession(self.stub)
        return old

    async def refresh(self) -> bool:
        """True when the scheduler answers and has an executor; learns max_model_len from it."""
        try:
            limits = await self.stub.Limits(scheduler_pb2.LimitsRequest(), timeout=2)
        except grpc.RpcError:
            return False
        wrong = self.wrong_model       # a scheduler without executors names no model: nothing changes
        if self.expect_model and limits.model:
            wrong = "" if limits.model == self.expect_model else (
                f"the scheduler for {self.model_name!r} serves {limits.model}, not {self.expect_model}: the "
                f"gateway's models file pairs them wrongly")
        if wrong != self.wrong_model:
            self.wrong_model = wrong
            if wrong:
                log.error("%s; %r is not served until it is fixed", wrong, self.model_name)
        if wrong:
            return False
        if limits.max_model_len:
            self.max_model_len = limits.max_model_len
        return bool(limits.max_model_len)

    def check_model(self, name: str) -> None:
        """For routes where only the tokenizer matters: the served model or an adapter (they share it)."""
        if name and name != self.model_name and name not in self.adapters.known:
            raise ModelNotFound(name, self.model_name)

    async def resolve_model(self, name: str) -> str:
        """The LoRA adapter a request's `model` picks ("" for the served model); ModelNotFound otherwise."""
        return await self.adapters.resolve(self, name)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt; one that cannot fit the context is refused before it is tokenized."""
        return await self._off_loop(self._encode, text, add_special_tokens, await self._text_limit())

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> list[int]:
        check_chat(messages)   # `tools`: the template's variable (gateway.tools.rendering)
        return await self._off_loop(self._encode_chat, messages, add_generation_prompt, add_special_tokens,
                                    await self._text_limit(), tools, template_kwargs)

    async def encode_chat_continuing(self, messages: list[dict], tools: list[dict] | None,
                                     prior: tuple[str, list[int]] | None) -> tuple[list[int], str]:
        """(token ids, rendered text) of a chat with a generation prompt. `prior`: the rendered text and the exact
        token ids of an earlier turn's prompt and output (a stored response). Where this chat's rendering starts
        with that text, its ids start with those ids and only the rest is tokenized: the model's own tokens, which
        the prefix cache holds, rather than their text tokenized anew, which may split otherwise and miss it."""
        check_chat(messages)
        limit = await self._text_limit()

        def encode() -> tuple[list[int], str]:
            text = self._render_chat(messages, True, limit, tools)
            if prior is not None and prior[0] and text.startswith(prior[0]):
                return list(prior[1]) + self.tokenizer.encode(text[len(prior[0]):], add_special_tokens=False), text
            return self.tokenizer.encode(text, add_special_tokens=False), text

        return await self._off_loop(encode)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of token ids the model knows, special tokens included (as vLLM's /detokenize gives it)."""
        if token_ids:   # no tokens: no text
            check_prompt(token_ids, self.tokenizer.vocab_size, "tokens")
        return await self._off_loop(self.tokenizer.decode, token_ids, False)

    def _encode(self, text: str, add_special_tokens: bool, limit: int) -> list[int]:
        self.tokenizer.refuse_oversize(text, limit, "prompt", self.max_model_len)
        return self.tokenizer.encode(text, add_special_tokens)

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool, limit: int,
                     tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt, tools, template_kwargs)
        except ChatTemplateError as e:
            raise InvalidRequestError("messages", str(e)) from None
        self.tokenizer.refuse_oversize(text, limit, "messages", self.max_model_len)
        return text

    def _encode_chat(self, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool,
                     limit: int, tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        text = self._render_chat(messages, add_generation_prompt, limit, tools, template_kwargs)
        # The rendered template already holds its special tokens, unless it is asked for more.
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def _text_limit(self) -> int:
        """The most bytes a prompt that can still fit may have; 0 while the context length is unknown (no
        executor seen yet: then only the body size limit bounds a prompt)."""
        if not self.max_model_len:
            await self.refresh()
        # A prompt must leave room for one output token, so it has at most max_model_len - 1 tokens.
        return max(self.max_model_len - 1, 0) * self.tokenizer.max_token_bytes

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def check(self, prompt_ids: list[int], p: GenerationParams) -> None:
        """Validate before anything reaches the scheduler (request_checks.py); resolves max_tokens."""
        check_request(prompt_ids, p, self.max_model_len, self.tokenizer.vocab_size)

    def check_params(self, p: GenerationParams) -> None:
        """What can be checked without the prompt: the front ends call it before tokenizing."""
        check_params(p)

    async def generate(self, prompt_ids: list[int], p: GenerationParams, usage: Usage,
                       obs: Observation | None = None, request_id: str | None = None,
                       resume_context: bytes | None = None) -> AsyncIterator[Chunk]:
        """Text deltas of all n completions of a request check() accepted, interleaved as they come.
        Leaving early aborts them all, except resumable ones (under `request_id`'s choice ids, with the
        `resume_context` a resume answers them from: resumed.py), which the scheduler keeps for their client.
        `obs` times the first token and names the parent span."""
        if self.wrong_model:
            raise SchedulerError(grpc.StatusCode.UNAVAILABLE, self.wrong_model)
        usage.prompt_tokens = len(prompt_ids)
        traceparent = ""
        if obs is not None:
            obs.requested(p, len(prompt_ids))
            traceparent = obs.traceparent()
        queue: asyncio.Queue = asyncio.Queue()
        base = uuid.uuid4().hex[:16]
        ids = choice_ids(request_id, p.n) if resume_context is not None else [f"{base}-{i}" for i in range(p.n)]
        tasks = [asyncio.create_task(self._one(rid, i, prompt_ids, p, queue, usage, traceparent, resume_context))
                 for i, rid in enumerate(ids)]
        try:
            done = 0
            held = None
            while done < p.n:
                item, held = (held, None) if held is not None else (await queue.get(), None)
                if isinstance(item, BaseException):
                    raise item
                # When the client side falls behind the scheduler (a busy gateway), what has piled up for a
                # completion goes out as one delta: one event and one write instead of one per token, so a
                # loaded gateway spends less per token instead of falling further behind. Unloaded, the queue
                # holds one delta at a time and nothing changes.
                while item.finish_reason is None and not queue.empty():
                    later = queue.get_nowait()
                    if not isinstance(later, Chunk) or later.index != item.index:
                        held = later
                        break
                    item = item.then(later)
                if obs is not None and item.token_ids:
                    obs.token()
                yield item
                if item.finish_reason is not None:
                    done += 1
        finally:
            for t in tasks:
                t.cancel()   # a cancelled completion aborts its request at the scheduler

    async def _one(self, rid, index, prompt_ids, p: GenerationParams, queue, usage, traceparent: str,
                   resume_context: bytes | None = None) -> None:
        # Whatever goes wrong in here reaches the client through the queue: an exception that escaped this
        # task would leave generate() waiting for ever.
        try:
            await self._stream(rid, index, prompt_ids, p, queue, usage, traceparent, resume_context)
        except Exception as e:   # noqa: BLE001 -- handed on, not swallowed
            queue.put_nowait(e)

    async def _stream(self, rid, index, prompt_ids, p: GenerationParams, queue, usage, traceparent: str,
                      resume_context: bytes | None = None) -> None:
        sp = p.sampling
        if sp.seed is not None:
            # n seeded completions must still differ from each other, and stay inside the uint64 field.
            sp = replace(sp, seed=(sp.seed + index) % (UINT64_MAX + 1))
        entry = self.journal.add(Entry(rid, prompt_ids, sp, p.priority, p.cache_salt or "", traceparent,
                                       IncrementalDetokenizer(self.tokenizer), StopMatcher(p.stop),
                                       adapter=p.adapter, tenant=p.tenant, resume_context=resume_context))
        lost_at: float | None = None      # when the scheduler was lost with this request unfinished
        try:
            while True:
                if lost_at is not None:
                    await self._wait_for_scheduler(lost_at)
                got_output, done = await self._submission(entry, index, queue, usage, lost_at)
                if done:
                    return
                if got_output or lost_at is None:
                    lost_at = time.monotonic()
                else:
                    await asyncio.sleep(0.2)   # lost again before a word: the scheduler is not really back yet
        finally:
            self.journal.remove(entry)

    async def _submission(self, entry: Entry, index: int, queue, usage, lost_at: float | None) -> tuple[bool, bool]:
        """Submit the journal entry once and stream what comes back. Returns (any output came, the request is
        over): it is over when it finished, stopped on a stop string, or failed; not over when the scheduler
        was lost under it."""
        session = self.session
        outputs = out = None
        if lost_at is not None and entry.resumable:
            # The scheduler may still hold it (the session broke, the scheduler did not): take it back, with what
            # it made meanwhile. Otherwise (a new scheduler) it is submitted again, under the same id.
            outputs, out = await self._reclaim(entry)
        if outputs is None:
            submit = entry.submit_request()
            outputs = session.submit(submit)
        rid = entry.request_id if entry.resumable else submit.request_id
        if lost_at is not None and self.metrics is not None:
            self.metrics.resumed.inc()
        finished = got_output = stopped = False
        try:
            while True:
                if out is None:
                    out = await outputs.get()
                if isinstance(out, SessionLost):
                    finished = True          # nothing to abort on a stream that is gone
                    return got_output, False
                error = out if isinstance(out, SchedulerError) else output_error(out)
                if error is not None:
                    finished = True   # refused or cut off: nothing left to abort
                    queue.put_nowait(error)
                    return got_output, True
                if not got_output and lost_at is not None and self.metrics is not None:
                    self.metrics.resume_wait.observe(time.monotonic() - lost_at)
                got_output = True
                usage.completion_tokens += len(out.token_ids)
                if index == 0 and entry.submissions == 1:
                    usage.cached_prompt_tokens = out.num_cached_tokens
                entry.delivered.extend(out.token_ids)
                chunk = relay(entry, index, list(out.token_ids), out.finish_reason or None, logprobs_of(out))
                queue.put_nowait(chunk)
                if chunk.finish_reason is not None:
                    # A stop string ended it here: the scheduler is still to be told (finally), with an abort.
                    finished, stopped = out.finish_reason != "", out.finish_reason == ""
                    return got_output, True
                out = None
        finally:
            # Also on cancellation (client gone, or another of the n completions failed): abort at the scheduler,
            # or have it keep a resumable request for its client.
            # (`unannounced` holds stream ids; a completion's id is its stream's, or that and ".<index>".)
            session.done(rid, abort=not finished, detach=entry.resumable and not stopped
                         and entry.request_id.partition(".")[0] not in self.unannounced, queue=outputs)

    async def _reclaim(self, entry: Entry):
        """Take a resumable request back from the scheduler after the session broke: (its outputs' queue, an
        output with what the client has not had yet), or (None, None) where the scheduler holds no such request."""
        outputs, first = await take_over(self.session, entry.request_id, entry.tenant.name)
        if isinstance(first, SessionLost):
            return outputs, first
        if isinstance(first, SchedulerError) or output_error(first) is not None:
            self.session.done(entry.request_id, abort=False, queue=outputs)
            return None, None
        d = len(entry.delivered)
        rest = scheduler_pb2.RequestOutput(request_id=entry.request_id, token_ids=first.token_ids[d:],
                                           finish_reason=first.finish_reason,
                                           num_cached_tokens=first.num_cached_tokens)
        rest.logprobs.extend(first.logprobs[d:])
        return outputs, rest

    async def _wait_for_scheduler(self, lost_at: float) -> None:
        """Hold the request until the scheduler serves again; past --scheduler-wait-seconds, fail it."""
        left = lost_at + self.scheduler_wait_seconds - time.monotonic()
        try:
            await asyncio.wait_for(self._serving.wait(), max(left, 0))
        except TimeoutError:
            raise SchedulerError(grpc.StatusCode.UNAVAILABLE,
                                 SCHEDULER_GONE.format(self.scheduler_wait_seconds)) from None


def choice_ids(stream_id: str, n: int) -> list[str]:
    """The scheduler's ids of a resumable stream's n completions: the stream's own id for the first, so that a
    resume finds it (and its context, which says n) by the id the client has."""
    return [stream_id] + [f"{stream_id}.{i}" for i in range(1, n)]


def relay(entry: Entry, index: int, token_ids: list[int], finish: str | None, logprobs) -> Chunk:
    """The chunk a client gets for `token_ids` of `entry`: its text through the detokenizer and the stop
    strings, and its end (a stop string's match ends it as "stop")."""
    stops = entry.stops
    text = stops.push(entry.detokenizer.push(token_ids))
    if stops.matched is not None:
        return Chunk(index, text, token_ids, "stop", stops.matched, logprobs)
    if finish is not None:
        text += stops.push(entry.detokenizer.flush()) + stops.flush()
        stop = None
        if finish == "stop" and token_ids and token_ids[-1] in entry.sampling.stop_token_ids:
            stop = str(token_ids[-1])
        return Chunk(index, text, token_ids, finish, stop, logprobs)
    return Chunk(index, text, token_ids, None, None, logprobs)


def logprobs_of(out) -> list | None:
    if not out.logprobs:
        return None
    return [list(zip(lp.token_ids, lp.logprobs, strict=True)) for lp in out.logprobs]
