"""LoRA adapters at the edge: a request names one by `model`; /v1/models lists them; vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter load and unload them (behind the API keys, like every route).

The scheduler keeps the list (adapter_registry.py), the gateway a copy (adapter_names.py). An unknown model is a
404 with code `model_not_found`, as OpenAI answers.
"""

from __future__ import annotations

import grpc
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.generation.adapter_names import AdapterNames, ModelNotFound
from gateway.http_api.responses import error
from stepwire.contract import InvalidRequestError
from stepwire.internal import scheduler_pb2

RPC_SECONDS = 70.0    # a load waits for an executor to read and check the adapter


class LoadLora(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=128)
    lora_path: str = Field(max_length=4096)
    # A gateway of several models (served_models.py) loads an adapter onto the one this names.
    base_model: str = Field("", max_length=128)


class UnloadLora(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=128)
    lora_int_id: int | None = None     # vLLM's clients send it; the name alone decides here
    base_model: str = Field("", max_length=128)


_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.ALREADY_EXISTS: 400, grpc.StatusCode.NOT_FOUND: 404,
         grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.PERMISSION_DENIED: 403}


def _refused(e: grpc.aio.AioRpcError):
    status = _HTTP.get(e.code(), 503)
    code = "model_not_found" if e.code() == grpc.StatusCode.NOT_FOUND else None
    return error(status, e.details() or e.code().name, "lora_name" if status == 400 else None,
                 "server_error" if status == 503 else "invalid_request_error", code)


def _base(models, name: str, adapter: str = ""):
    """The model an adapter route acts on: the one model, the one `base_model` names, or (unload) the one that
    has the adapter."""
    if len(models) == 1 and not name:
        return models.first
    if name:
        b = models.backends.get(name)
        if b is None:
            raise ModelNotFound(name, list(models.backends))
        return b
    b = models.of_name(adapter) if adapter else None
    if b is None:
        raise InvalidRequestError("base_model", f"this server serves several models ({models.names}): "
                                  "base_model names the one the adapter is for")
    return b


def add_lora_routes(app: FastAPI, models) -> None:
    @app.exception_handler(ModelNotFound)
    async def _not_found(request, exc: ModelNotFound):
        return error(404, exc.message, "model", code="model_not_found")

    @app.post("/v1/load_lora_adapter")
    async def load(req: LoadLora):
        backend = _base(models, req.base_model)
        names: AdapterNames = backend.adapters
        try:
            await backend.stub.LoadAdapter(scheduler_pb2.LoadAdapterRequest(name=req.lora_name, path=req.lora_path),
                                           timeout=RPC_SECONDS)
        except grpc.aio.AioRpcError as e:
            return _refused(e)
        await names.refresh(backend.stub)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(req: UnloadLora):
        for b in models if len(models) > 1 and not req.base_model else ():
            await b.adapters.refresh(b.stub)
        backend = _base(models, req.base_model, req.lora_name)
        names: AdapterNames = backend.adapters
        try:
            await backend.stub.UnloadAdapter(scheduler_pb2.UnloadAdapterRequest(name=req.lora_name), timeout=10)
        except grpc.aio.AioRpcError as e:
            return _refused(e)
        names.known.pop(req.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def model_cards(backend) -> list[dict]:
    """/v1/models' entries: the served model, then each adapter with the base as its parent."""
    base = {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "stepwire",
            "root": backend.model_name, "parent": None, "max_model_len": backend.max_model_len}
    return [base] + [{"id": a.name, "object": "model", "created": int(a.created), "owned_by": "stepwire",
                      "root": a.path, "parent": backend.model_name, "max_model_len": backend.max_model_len}
                     for a in await backend.adapters.refresh(backend.stub)]
