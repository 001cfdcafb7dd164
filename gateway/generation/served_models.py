"""The models one gateway serves, each by the name clients use, each with its own scheduler, tokenizer, chat
template and adapters (a Backend); a request goes to the one its `model` names.

A deployment of several models runs a scheduler per model (docs/multimodel.md says why): a model's queues, block
pools, prefix cache, KV moves and executors are its own, so one model's flood or outage stays its own, and the
gateways are the one place every model meets. The models come from a models file (JSON):

    {"models": [{"name": "smollm2", "model": "/models/SmolLM2-135M-Instruct", "scheduler": "sched-smollm2:50051"},
                {"name": "smollm2-small", "model": "/models/SmolLM2-4-layers", "scheduler": "sched-small:50051"}]}

`model` is the directory the gateway reads the tokenizer and chat template from; the scheduler reports which model
directory its executors serve, and a gateway whose file pairs a name with another model's scheduler does not serve
that name (a request for it is a 503 naming the mismatch) rather than answer with the wrong model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.generation.adapter_names import ModelNotFound
from gateway.generation.backend import Backend
from gateway.generation.resumed import Resumed, resume
from gateway.generation.scheduler_session import SchedulerError
from gateway.text.reasoning import PARSERS as REASONING_PARSERS
from gateway.text.tool_family import PARSERS as TOOL_CALL_PARSERS
from stepwire.contract import InvalidRequestError

MODEL_NAME = r"^[A-Za-z0-9._][A-Za-z0-9._:/@+-]{0,127}$"


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=MODEL_NAME, description="the name clients put in `model`")
    model: str = Field(min_length=1, description="the model directory: tokenizer and chat template")
    scheduler: str = Field(min_length=3, description="host:port of this model's scheduler")
    reasoning_parser: Literal[REASONING_PARSERS] | None = Field(
        None, description="this model's --reasoning-parser (unset: the gateway's)")
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = Field(
        None, description="this model's --tool-call-parser (unset: the gateway's)")


class ModelsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelEntry] = Field(min_length=1, max_length=64)


class ModelsFileError(ValueError):
    """Not a valid models file; the text says where."""


def read_models_file(path: str) -> list[ModelEntry]:
    try:
        spec = ModelsFile.model_validate(json.loads(Path(path).read_text()))
    except OSError as e:
        raise ModelsFileError(f"models file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ModelsFileError(f"models file {path}: not JSON: {e}") from None
    except ValidationError as e:
        raise ModelsFileError(f"models file {path}: {e}") from None
    names = [m.name for m in spec.models]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ModelsFileError(f"models file {path}: {', '.join(twice)} named twice")
    return spec.models


class ServedModels:
    """Every model's Backend, by name. With one model a request may leave `model` empty, as before."""

    def __init__(self, backends: list[Backend]):
        assert backends and len({b.model_name for b in backends}) == len(backends)
        self.backends = {b.model_name: b for b in backends}
        self.first = backends[0]
        if self.first.metrics is not None:
            self.first.metrics.journal.set_function(lambda: sum(len(b.journal) for b in self))

    def __iter__(self):
        return iter(self.backends.values())

    def __len__(self) -> int:
        return len(self.backends)

    @property
    def names(self) -> str:
        return ", ".join(repr(n) for n in self.backends)

    @property
    def ready(self) -> bool:
        """The gateway serves while any of its models does; a model without a serving scheduler answers 503 for
        itself alone."""
        return any(b.ready for b in self)

    def of_name(self, name: str) -> Backend | None:
        """The backend `name` names as a model or as one of its known adapters, without asking anyone."""
        if len(self.backends) == 1 and not name:
            return self.first
        b = self.backends.get(name)
        if b is not None:
            return b
        return next((b for b in self if name in b.adapters.known), None)

    async def pick(self, name: str) -> tuple[Backend, str]:
        """(the backend, the adapter: "" for the model itself) a request's `model` picks; ModelNotFound if none."""
        if len(self.backends) == 1:
            return self.first, await self.first.resolve_model(name)
        if not name:
            raise InvalidRequestError("model", f"this server serves several models ({self.names}): name one")
        b = self.backends.get(name)
        if b is not None:
            return b, ""
        if re.match(MODEL_NAME, name):
            # An adapter loaded through another gateway since this one last asked: each scheduler is asked (at most
            # once per AdapterNames.REFRESH_SECONDS), and the first that has it takes the request.
            for b in self:
                try:
                    return b, await b.resolve_model(name)
                except ModelNotFound:
                    continue
        raise ModelNotFound(name, list(self.backends))

    def for_tokenizer(self, name: str) -> Backend:
        """For /tokenize and /detokenize: the model whose tokenizer `name` picks (an adapter shares its base's)."""
        b = self.of_name(name)
        if b is None:
            raise ModelNotFound(name, list(self.backends)) if name else InvalidRequestError(
                "model", f"this server serves several models ({self.names}): name one")
        return b

    async def resume(self, stream_id: str, tenant, seen: list[int] | None) -> tuple[Backend, Resumed]:
        """Take a resumable stream over from whichever model's scheduler keeps it (a stream id names no model;
        the schedulers that do not know it answer NOT_FOUND, which costs one call each)."""
        missing = None
        for b in self:
            try:
                return b, await resume(b, stream_id, tenant, seen)
            except SchedulerError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                missing = e
        raise missing
