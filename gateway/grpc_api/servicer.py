"""The public gRPC API, stepwire.v1.Generation, on the same core as the HTTP API."""

from __future__ import annotations

import json
import uuid

import grpc

from gateway.access.auth import ApiKeys, grpc_tenant
from gateway.generation.adapter_names import ModelNotFound
from gateway.generation.backend import Backend
from gateway.generation.chat_output import ReasoningPlan, chat_outputs, whole_output
from gateway.generation.params import GenerationParams, Usage
from gateway.generation.reasoning_requests import plan_reasoning
from gateway.generation.resumed import context_of
from gateway.generation.scheduler_session import SchedulerError
from gateway.generation.served_models import ServedModels
from gateway.generation.structured_requests import from_v1, one_constraint
from gateway.generation.telemetry import GatewayMetrics, Observation
from gateway.http_api.responses import rate_limit_headers
from gateway.tools.calls import ToolPlan, constraint, tool_plan
from gateway.tools.output import finish_reason
from gateway.tools.parser import Delta
from gateway.tools.rendering import chat_for_template
from stepwire.contract import InvalidRequestError, SamplingParams
from stepwire.v1 import generation_pb2, generation_pb2_grpc

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = {None: generation_pb2.FINISH_REASON_UNSPECIFIED, "stop": generation_pb2.FINISH_REASON_STOP,
          "length": generation_pb2.FINISH_REASON_LENGTH, "abort": generation_pb2.FINISH_REASON_ABORT,
          "tool_calls": generation_pb2.FINISH_REASON_TOOL_CALLS}


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, models: ServedModels | Backend, metrics: GatewayMetrics, keys: ApiKeys | None = None):
        self.models = ServedModels([models]) if isinstance(models, Backend) else models
        self.metrics = metrics
        self.keys = keys

    def _observe(self, context, method: str, request) -> Observation:
        operation = "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"
        return Observation(self.metrics, "grpc", f"{SERVICE}/{method}", operation,
                           dict(context.invocation_metadata() or ()), request.model or self.models.first.model_name)

    async def _prepare(self, request, context, obs: Observation
                       ) -> tuple[Backend, list[int], GenerationParams, ToolPlan, ReasoningPlan | None]:
        try:
            params = _params(request)
            b, params.adapter = await self.models.pick(request.model)
            params.tenant = grpc_tenant(self.keys, context).for_model(b.model_name)
            b.check_params(params)   # before tokenizing: a request refused anyway costs no tokenizer time
            which = request.WhichOneof("prompt")
            tools = tool_plan(*_tool_fields(request), fmt=b.tokenizer.tool_format)
            budget = request.params.max_reasoning_tokens if request.params.HasField("max_reasoning_tokens") else None
            reasoning = None
            if tools is not None and which != "chat":
                raise InvalidRequestError("tools", "tools need a chat prompt")
            so = from_v1(request.params)
            params.sampling.structured_output = await one_constraint(
                ("structured_outputs", so) if so is not None else None, constraint(tools, b.tokenizer.special_markers),
                b.tokenizer)
            if which == "text":
                prompt = await b.encode(request.text)
            elif which == "token_ids":
                prompt = list(request.token_ids.ids)
            elif which == "chat":
                messages, template_tools = chat_for_template(_messages(request.chat), tools, b.tokenizer.knows_tools)
                prompt = await b.encode_chat(messages, tools=template_tools)
                prompt, reasoning, params.sampling.reasoning = plan_reasoning(
                    b.tokenizer, prompt, params.sampling.structured_output is not None, budget,
                    "params.max_reasoning_tokens")
            else:
                raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")
            if budget is not None and which != "chat":
                raise InvalidRequestError("params.max_reasoning_tokens", "a reasoning budget needs a chat prompt")
            if not b.max_model_len:
                await b.refresh()
            b.check(prompt, params)
        except InvalidRequestError as e:
            code = grpc.StatusCode.NOT_FOUND if isinstance(e, ModelNotFound) else grpc.StatusCode.INVALID_ARGUMENT
            obs.end(code.name, error=str(e))
            await context.abort(code, str(e))
        return b, prompt, params, tools, reasoning

    @staticmethod
    def _logprobs(per_token, b: Backend) -> list:
        tt = b.tokenizer.token_text
        out = []
        for pairs in per_token or []:
            (tok, lp), top = pairs[0], pairs[1:]
            out.append(generation_pb2.Logprobs(
                sampled=generation_pb2.TokenLogprob(token_id=tok, logprob=lp, token=tt(tok)),
                top=[generation_pb2.TokenLogprob(token_id=t, logprob=v, token=tt(t)) for t, v in top]))
        return out

    async def Generate(self, request, context):
        obs = self._observe(context, "Generate", request)
        b, prompt, params, tools, reasoning = await self._prepare(request, context, obs)
        usage = Usage()
        comps = [generation_pb2.Completion(index=i) for i in range(params.n)]
        finish: list[str | None] = [None] * params.n
        try:
            async for c in b.generate(prompt, params, usage, obs):
                comp = comps[c.index]
                comp.text += c.text
                comp.token_ids.extend(c.token_ids)
                comp.logprobs.extend(self._logprobs(c.logprobs, b))
                if c.finish_reason is not None:
                    finish[c.index] = c.finish_reason
                    comp.finish_reason = FINISH[c.finish_reason]
                    comp.stop = c.stop or ""
            for comp, reason in zip(comps, finish, strict=True):
                _read(comp, reason, tools, reasoning)
            obs.end("OK", usage, finish)
        except SchedulerError as e:
            obs.end(e.code().name, error=e.details())
            await context.abort(e.code(), e.details(), trailing_metadata=_rate_metadata(e))
        finally:
            obs.end("CANCELLED", usage, finish, error="client cancelled")   # a no-op once ended
        return generation_pb2.GenerateResponse(id=f"gen-{uuid.uuid4().hex}",
                                               model=params.adapter or b.model_name,
                                               completions=comps, usage=_usage(usage))

    async def GenerateStream(self, request, context):
        obs = self._observe(context, "GenerateStream", request)
        b, prompt, params, tools, reasoning = await self._prepare(request, context, obs)
        usage = Usage()
        rid = f"gen-{uuid.uuid4().hex}"
        # A stream its client may resume (Resume), by this id.
        context_bytes = context_of(False, rid, 0, params.adapter or b.model_name, params.stop,
                                   params.sampling.stop_token_ids, True, len(prompt),
                                   params.sampling.logprobs, tools, params.n, reasoning)
        await context.send_initial_metadata((("x-stepwire-stream-id", rid),))
        deltas = b.generate(prompt, params, usage, obs, request_id=rid, resume_context=context_bytes)
        async for message in self._stream(b, deltas, rid, params.n, usage, obs, context, tools, reasoning):
            yield message

    async def Resume(self, request, context):
        obs = Observation(self.metrics, "grpc", f"{SERVICE}/Resume", "resume",
                          dict(context.invocation_metadata() or ()),
                          self.models.first.model_name if len(self.models) == 1 else "")
        seen = list(request.after_each) or ([request.after] if request.HasField("after") else None)
        try:
            b, r = await self.models.resume(request.id, grpc_tenant(self.keys, context), seen)
        except SchedulerError as e:
            obs.end(e.code().name, error=e.details())
            await context.abort(e.code(), e.details())
        if seen is not None and all(s % 2 for s in seen):          # the client saw every completion end
            obs.end("OK", r.usage)
            return
        async for message in self._stream(b, r.chunks, request.id, r.context.get("n", 1), r.usage, obs, context,
                                          r.tools, ReasoningPlan.from_json(r.context.get("reasoning")), seen=seen,
                                          seen_text=r.seen_text):
            yield message

    async def _stream(self, b: Backend, deltas, rid: str, n: int, usage: Usage, obs, context, tools, reasoning,
                      seen: list[int] | None = None, seen_text: list[str] | None = None):
        """The stream's messages; each one held back until the next is known, so that usage rides on the last.
        `seen`: each completion's last sequence the client has (a resumed stream), `seen_text` their text."""
        readers = chat_outputs(tools, reasoning, n, rid, seen_text)
        sent = [0] * n if seen is None else [s // 2 for s in seen]
        last = None
        finish: list[str | None] = [None] * n
        try:
            async for c in deltas:
                if c.finish_reason is not None:
                    finish[c.index] = c.finish_reason
                if last is not None:
                    yield last
                sent[c.index] += len(c.token_ids)
                # Reasoning and tool calls out of the text, and text held back in case it starts a marker or a call.
                thought, got = readers[c.index].feed(c.text, last=c.finish_reason is not None)
                reason = finish_reason(c.finish_reason, readers[c.index].called)
                last = generation_pb2.GenerateStreamResponse(
                    id=rid, index=c.index, text=got.content, reasoning=thought, token_ids=c.token_ids,
                    finish_reason=FINISH[reason], stop=c.stop or "", logprobs=self._logprobs(c.logprobs, b),
                    tool_calls=_pieces(got),
                    sequence=2 * sent[c.index] + (c.finish_reason is not None))
            if last is not None:
                last.usage.CopyFrom(_usage(usage))   # usage rides on the very last message
                yield last
            obs.end("OK", usage, finish)
        except SchedulerError as e:
            obs.end(e.code().name, error=e.details())
            await context.abort(e.code(), e.details(), trailing_metadata=_rate_metadata(e))
        finally:
            obs.end("CANCELLED", usage, finish, error="client cancelled")   # a no-op once ended

    async def Tokenize(self, request, context):
        try:
            b = self.models.for_tokenizer(request.model)
            b.check_model(request.model)
            if request.WhichOneof("input") == "chat":
                ids = await b.encode_chat(_messages(request.chat))
            else:
                # A text that could never fit the context is refused here too, before it is tokenized.
                ids = await b.encode(request.text, add_special_tokens=request.add_special_tokens)
        except InvalidRequestError as e:
            code = grpc.StatusCode.NOT_FOUND if isinstance(e, ModelNotFound) else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))
        return generation_pb2.TokenizeResponse(token_ids=ids, max_model_len=b.max_model_len)

    async def ModelInfo(self, request, context):
        try:
            b = self.models.for_tokenizer(request.model)
        except InvalidRequestError as e:
            code = grpc.StatusCode.NOT_FOUND if isinstance(e, ModelNotFound) else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))
        if not b.max_model_len:
            await b.refresh()
        return generation_pb2.ModelInfoResponse(model=b.model_name, max_model_len=b.max_model_len,
                                                vocab_size=b.tokenizer.vocab_size,
                                                has_chat_template=b.tokenizer.chat_template is not None)


def _messages(chat) -> list[dict]:
    out = []
    for m in chat.messages:
        d = {"role": m.role, "content": m.content, "tool_call_id": m.tool_call_id, "name": m.name}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in m.tool_calls]
        out.append(d)
    return out


def _tool_fields(request) -> tuple[list[dict], object, bool | None]:
    """The request's tool fields in OpenAI's shapes, for gateway.tools.calls.tool_plan."""
    tools = []
    for i, t in enumerate(request.tools):
        try:
            parameters = json.loads(t.parameters) if t.parameters else None
        except (ValueError, RecursionError):   # nested past what the parser takes counts as not JSON
            raise InvalidRequestError(f"tools[{i}].parameters", "is not valid JSON") from None
        tools.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                       "parameters": parameters}})
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    choice = {"mode": request.tool_choice.mode, None: None,
              "function": {"type": "function", "function": {"name": request.tool_choice.function}}}[which]
    return tools, choice, request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None


def _read(comp: generation_pb2.Completion, reason: str | None, tools: ToolPlan | None,
          reasoning: ReasoningPlan | None) -> None:
    """A whole completion's text, read as its request asks: reasoning apart, calls apart."""
    thought, content, calls = whole_output(comp.text, tools, reasoning)
    comp.reasoning = thought or ""
    comp.text = content or ""
    if calls:
        comp.tool_calls.extend(generation_pb2.ToolCall(index=i, id=c.id, name=c.name, arguments=c.arguments)
                               for i, c in enumerate(calls))
        comp.finish_reason = FINISH[finish_reason(reason, True)]


def _rate_metadata(e: SchedulerError) -> tuple:
    """A tenant's limit: the HTTP API's Retry-After and x-ratelimit-* headers as trailing metadata."""
    return tuple(rate_limit_headers(e.rate_limited).items()) if e.rate_limited is not None else ()


def _pieces(d: Delta) -> list:
    return [generation_pb2.ToolCall(index=c.index, id=c.id or "", name=c.name or "", arguments=c.arguments)
            for c in d.calls]


def _params(request) -> GenerationParams:
    """Proto3 `optional` fields that are unset take the same defaults as the HTTP API's."""
    p = request.params
    has = p.HasField
    sampling = SamplingParams(
        temperature=p.temperature if has("temperature") else 1.0, top_p=p.top_p if has("top_p") else 1.0,
        top_k=p.top_k if has("top_k") else -1, min_p=p.min_p if has("min_p") else 0.0,
        seed=p.seed if has("seed") else None, stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens, logprobs=p.logprobs if has("logprobs") else None)
    return GenerationParams(sampling, max_tokens=p.max_tokens if has("max_tokens") else None, stop=list(p.stop),
                            n=p.n if has("n") else 1, priority=request.priority,
                            cache_salt=request.cache_salt or None)


def _usage(u: Usage) -> generation_pb2.Usage:
    return generation_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                cached_prompt_tokens=u.cached_prompt_tokens)
