"""vLLM's /tokenize and /detokenize, in vLLM's request and response shapes: benchmark clients written for
vLLM ask them for prompt lengths and the context size."""

from __future__ import annotations

from typing import Annotated

from fastapi import Body, FastAPI
from pydantic import BaseModel, Discriminator, Tag

from gateway.http_api.bodies import ChatMessage, Strict, message_dicts


class TokenizeText(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(Strict):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    # The rendered template already holds its special tokens; true adds the tokenizer's (a BOS) on top.
    add_special_tokens: bool = False
    return_token_strs: bool = False


def _shape(body) -> str:
    # One body, two shapes: the one with messages is a chat. Naming the shape keeps a refusal's wording
    # about that shape's fields instead of listing both shapes' failures.
    return "chat" if isinstance(body, dict) and "messages" in body else "text"


TokenizeRequest = Annotated[Annotated[TokenizeText, Tag("text")] | Annotated[TokenizeChat, Tag("chat")],
                            Discriminator(_shape)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def add_tokenize_routes(app: FastAPI, models) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
    async def tokenize(req: Annotated[TokenizeRequest, Body()]):
        backend = models.for_tokenizer(req.model or "")
        backend.check_model(req.model or "")
        if isinstance(req, TokenizeChat):
            ids = await backend.encode_chat(message_dicts(req.messages), req.add_generation_prompt,
                                            req.add_special_tokens)
        else:
            # A text that could never fit the context is refused before it is tokenized, as for generation.
            ids = await backend.encode(req.prompt, req.add_special_tokens)
        if not backend.max_model_len:
            await backend.refresh()
        strs = [backend.tokenizer.token_text(t) for t in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=backend.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest):
        backend = models.for_tokenizer(req.model or "")
        backend.check_model(req.model or "")
        return DetokenizeResponse(prompt=await backend.decode(req.tokens))
