"""The Responses API's answer: its output items (an assistant message, function calls), the response object, and
the stream of semantic events the openai SDK folds into one (`client.responses.stream(...)`):

    response.created, response.in_progress,
    per item: response.output_item.added,
      a reasoning: response.reasoning_text.delta..., response.reasoning_text.done;
      a message: response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done;
      a call: response.function_call_arguments.delta..., response.function_call_arguments.done;
    response.output_item.done,
    response.completed (or response.incomplete at max_output_tokens, response.failed on an error).

Every event has its `sequence_number`; items are numbered by `output_index` in the order they open, and one
closes before the next opens, so the SDK's snapshot sees each item whole, as OpenAI sends them.
"""

from __future__ import annotations

import json
import uuid

from gateway.generation.chat_output import whole_output
from gateway.tools.parser import Delta


def _usage(run) -> dict:
    u = run.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def response_object(run, status: str, output: list[dict]) -> dict:
    req, sampling = run.req, run.p.sampling
    return {
        "id": run.id, "object": "response", "created_at": run.created, "status": status,
        "model": run.p.adapter or run.backend.model_name, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
        "store": req.store, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
        "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "metadata": req.metadata or {},
        "user": req.user, "reasoning": req.reasoning,
        "usage": _usage(run) if status in ("completed", "incomplete") else None,
    }


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def count_reasoning(run, text: str) -> None:
    """usage.output_tokens_details.reasoning_tokens: the reasoning's text counted in the model's tokens."""
    run.reasoning_tokens = len(run.backend.tokenizer.encode(text, add_special_tokens=False))


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(run, text: str) -> list[dict]:
    """A whole answer's items: its reasoning (from a model that reasons), its text as a message (there is always one
    unless calls are all it made), then its calls."""
    thought, content, calls = whole_output(text, run.plan, run.reasoning)
    # Items as the stream opens them: a reasoning item only for some reasoning, and an (empty) message only when
    # nothing else was said.
    items = [reasoning_item(thought)] if thought else []
    if thought:
        count_reasoning(run, thought)
    items += [message_item(content or "")] if content or not (calls or thought) else []
    return items + [call_item(c.id, c.name, c.arguments) for c in calls]


class EventStream:
    def __init__(self, run, reader):
        self.r, self.reader = run, reader
        self.seq = 0
        self.items: list[dict] = []        # in output_index order, as they end up
        self.open: dict | None = None      # the item being streamed
        self.text = ""                     # the open message's text so far

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def run(self):
        r = self.r
        yield self.event("response.created", response=response_object(r, "in_progress", []))
        yield self.event("response.in_progress", response=response_object(r, "in_progress", []))
        async for c in r.deltas():
            r.output_text += c.text
            r.output_ids += c.token_ids
            thought, got = self.reader.feed(c.text, last=c.finish_reason is not None)
            if c.finish_reason is not None:
                r.finish = c.finish_reason
            for event in self.deliver(thought, got):
                yield event
        if not self.items and self.open is None:
            for event in self._open(message_item("", "in_progress")):      # an empty answer is an empty message
                yield event
        for event in self._close():
            yield event
        status = "incomplete" if r.finish == "length" else "completed"
        await r.store(self.items)
        yield self.event(f"response.{status}", response=response_object(r, status, self.items))

    def failed(self, e) -> str:
        body = response_object(self.r, "failed", self.items)
        body["error"] = {"code": "server_error", "message": e.details()}
        return self.event("response.failed", response=body)

    def deliver(self, thought: str, got: Delta):
        if thought:
            if self.open is None or self.open["type"] != "reasoning":
                yield from self._close()
                yield from self._open(reasoning_item("", "in_progress"))
            self.text += thought
            yield self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.items),
                             content_index=0, delta=thought)
        if got.content:
            if self.open is None or self.open["type"] != "message":
                yield from self._close()
                yield from self._open(message_item("", "in_progress"))
            self.text += got.content
            yield self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items),
                             content_index=0, delta=got.content, logprobs=[])
        for piece in got.calls:
            if piece.id is not None:             # a call's first piece: its own item
                yield from self._close()
                yield from self._open(call_item(piece.id, piece.name, "", "in_progress"))
            if piece.arguments and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += piece.arguments
                yield self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                 output_index=len(self.items), delta=piece.arguments)

    def _open(self, item: dict):
        self.open, self.text = item, ""
        # A message opens with no content: its part is added by the next event, as OpenAI sends it.
        shown = {**item, "content": []} if item["type"] in ("message", "reasoning") else item
        yield self.event("response.output_item.added", output_index=len(self.items), item=shown)
        if item["type"] == "message":
            yield self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items),
                             content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                    "logprobs": []})

    def _close(self):
        item, index = self.open, len(self.items)
        if item is None:
            return
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            yield self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=self.text, logprobs=[])
            yield self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=part)
            item = {**item, "status": "completed", "content": [part]}
        elif item["type"] == "reasoning":
            yield self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=self.text)
            item = {**item, "status": "completed", "content": [{"type": "reasoning_text", "text": self.text}]}
            if self.text:
                count_reasoning(self.r, self.text)
        else:
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"])
            item = {**item, "status": "completed"}
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)
        self.open = None
