"""A message that does not decode is the caller's mistake: INVALID_ARGUMENT, not grpc's UNKNOWN.

grpc decodes a request before the service sees it and reports a failure there as an error of its own.
This interceptor hands the raw bytes through and decodes them in front of the method instead, so a
malformed message gets the status a client can act on, on every method of the server, streams included.
"""

from __future__ import annotations

import inspect

import grpc

MESSAGE = "the request message does not decode as {}"


async def _decode(raw: bytes, decode, context, name: str):
    try:
        return decode(raw)
    except Exception:   # protobuf raises DecodeError, and others for some corruptions
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE.format(name))


def _strict(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer
    out = handler.response_serializer

    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary_unary(raw, context):
            return await inner(await _decode(raw, decode, context, name), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=out)

    if handler.unary_stream:
        inner = handler.unary_stream
        if not inspect.isasyncgenfunction(inner):
            async def unary_stream_writer(raw, context):
                return await inner(await _decode(raw, decode, context, name), context)
            return grpc.unary_stream_rpc_method_handler(unary_stream_writer, response_serializer=out)

        async def unary_stream(raw, context):
            async for reply in inner(await _decode(raw, decode, context, name), context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=out)

    async def decoded(raws, context):
        async for raw in raws:
            yield await _decode(raw, decode, context, name)

    if handler.stream_unary:
        inner = handler.stream_unary

        async def stream_unary(raws, context):
            return await inner(decoded(raws, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=out)

    inner = handler.stream_stream
    if not inspect.isasyncgenfunction(inner):
        async def stream_stream_writer(raws, context):
            return await inner(decoded(raws, context), context)
        return grpc.stream_stream_rpc_method_handler(stream_stream_writer, response_serializer=out)

    async def stream_stream(raws, context):
        async for reply in inner(decoded(raws, context), context):
            yield reply

    return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=out)


class DecodeErrorsAreInvalidArgument(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _strict(handler, details.method.rsplit("/", 1)[-1])
