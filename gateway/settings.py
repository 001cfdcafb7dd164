"""The gateway process's settings: the model's tokenizer, the scheduler it forwards to, and its two ports."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from stepwire.contract.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    """Run the stepwire gateway. Every flag is also STEPWIRE_GATEWAY_<FLAG> (capitals, underscores)."""

    model_config = SettingsConfigDict(env_prefix="STEPWIRE_GATEWAY_", cli_prog_name="stepwire gateway")

    model: str = Field("models/SmolLM2-135M-Instruct", description="model directory (tokenizer, chat template)")
    served_model_name: str | None = Field(None, description="the name clients use; default: the directory's name")
    scheduler: str = Field("127.0.0.1:50051", description="host:port of the scheduler")
    host: str = Field("127.0.0.1", description="HTTP listen address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (OpenAI-compatible API, /health, /metrics)")
    grpc_address: str = Field("127.0.0.1:50050", description="host:port of the public gRPC API (stepwire.v1)")
