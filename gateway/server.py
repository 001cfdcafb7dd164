"""The gateway process: OpenAI-compatible HTTP (uvicorn) in front of the scheduler."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

import uvicorn

from gateway.core import Backend
from gateway.http_api import build_app
from gateway.tokenizer import ModelTokenizer

log = logging.getLogger("stepwire.gateway")


async def serve(model_dir: str, model_name: str, scheduler: str, host: str, port: int) -> None:
    backend = Backend(scheduler, ModelTokenizer(model_dir), model_name)
    while not await backend.refresh():
        log.info("waiting for the scheduler at %s to have an executor; retrying in 1s", scheduler)
        await asyncio.sleep(1)
    log.info("gateway serving %s on http://%s:%d (max_model_len %d)", model_name, host, port, backend.max_model_len)
    config = uvicorn.Config(build_app(backend), host=host, port=port, log_level="warning")
    await uvicorn.Server(config).serve()


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="stepwire gateway", description="Run the stepwire gateway.")
    ap.add_argument("--model", default=env("STEPWIRE_MODEL", "models/SmolLM2-135M-Instruct"),
                    help="model directory (tokenizer and chat template)")
    ap.add_argument("--served-model-name", default=env("STEPWIRE_SERVED_MODEL_NAME"))
    ap.add_argument("--scheduler", default=env("STEPWIRE_SCHEDULER_ADDRESS", "127.0.0.1:50051"))
    ap.add_argument("--host", default=env("STEPWIRE_HTTP_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("STEPWIRE_HTTP_PORT", "8000")))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = a.served_model_name or Path(a.model).name
    asyncio.run(serve(a.model, name, a.scheduler, a.host, a.port))


if __name__ == "__main__":
    main()
