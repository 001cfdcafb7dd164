"""The gateway process's settings: the model's tokenizer, the scheduler it forwards to, its ports, API keys
and request size, time and connection limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from gateway.text.reasoning import PARSERS as REASONING_PARSERS
from gateway.text.tool_family import PARSERS as TOOL_CALL_PARSERS
from security.tls import TLSSettings


class GatewaySettings(TLSSettings):
    """Run the stepwire gateway. Every flag is also STEPWIRE_GATEWAY_<FLAG> (capitals, underscores)."""

    model_config = SettingsConfigDict(env_prefix="STEPWIRE_GATEWAY_", cli_prog_name="stepwire gateway")

    model: str = Field("models/SmolLM2-135M-Instruct", description="model directory (tokenizer, chat template)")
    served_model_name: str | None = Field(None, description="the name clients use; default: the directory's name")
    scheduler: str = Field("127.0.0.1:50051", description="host:port of the scheduler")
    models_file: str = Field("", description="JSON file of the models this gateway serves, several behind one "
                             "API: each with the name clients use, its model directory (tokenizer, chat template) "
                             "and the host:port of its own scheduler (docs/multimodel.md); set, it takes the place "
                             "of --model, --served-model-name and --scheduler. Read at start")
    reasoning_parser: Literal[REASONING_PARSERS] = Field(
        "auto", description="how a model's reasoning is told from its answer (docs/reasoning.md): think (also "
        "deepseek_r1, qwen3) reads a <think>...</think> block into reasoning_content; none reads none; auto: think "
        "for a chat template whose generation prompt thinks (opens the block, or closes it when thinking is off). "
        "A models file's entry may set its own")
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = Field(
        "auto", description="the format a model writes its tool calls in, which tool_choice \"auto\" asks for and "
        "reads back (docs/tool_calling.md): hermes (<tool_call> blocks), llama3_json ({\"name\": ..., "
        "\"parameters\": ...}), mistral ([TOOL_CALLS][...]); auto: the chat template's, hermes for one that does "
        "not render tools. A models file's entry may set its own")
    host: str = Field("127.0.0.1", description="HTTP listen address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (OpenAI-compatible API, /health, /metrics)")
    grpc_address: str = Field("127.0.0.1:50050", description="host:port of the public gRPC API (stepwire.v1)")
    api_key_file: str = Field("", description="file of API keys, one a line (blank lines and # comments ignored), "
                              "re-read when it changes; keys also come from STEPWIRE_API_KEY (comma-separated). "
                              "No key from either: no authentication")
    tenants_file: str = Field("", description="JSON file of tenants: each with its API keys, its weight in the "
                              "scheduler's fair sharing of each step and its limits (docs/tenants.md); re-read "
                              "when it changes. Its keys are API keys too")
    health_port: int = Field(0, ge=0, le=65535, description="also serve /health and /metrics, never needing a key, "
                             "on this plain HTTP port on --host (for probes and Prometheus); 0: off")
    max_body_bytes: int = Field(2 << 20, ge=1, description="largest HTTP request body and gRPC request message, in "
                                "bytes: larger gets 413 or RESOURCE_EXHAUSTED")
    read_timeout_seconds: float = Field(30.0, gt=0, description="the longest a client may take to send a whole HTTP "
                                        "request, headers and body, counted from its connection or, on a kept-alive "
                                        "one, from the request's first byte: then 408 and the connection closes")
    shutdown_grace_seconds: float = Field(10.0, ge=0, le=3600, description="on SIGTERM, how long open streams "
                                          "may go on before they are cut; the scheduler keeps a cut stream for its "
                                          "client to resume on another gateway (GET /v1/streams/{id})")
    max_connections: int = Field(4096, ge=1, description="open HTTP connections per port (idle, slow and busy ones "
                                 "alike); one more is answered 503 and closed. Keep it below the process's file "
                                 "descriptor limit")
    scheduler_wait_seconds: float = Field(60.0, ge=0, description="when the scheduler is lost (a crash, a restart, "
                                          "SIGTERM), how long requests in flight wait for it to serve again before "
                                          "they fail UNAVAILABLE; those it serves again in time are resubmitted "
                                          "from the tokens already delivered")
    structured_compile_seconds: float = Field(5.0, gt=0, description="the longest a structured output's grammar "
                                              "(response_format, structured_outputs) may take to compile; longer "
                                              "is refused with 400, and other requests never wait on it")
    insecure: bool = Field(False, description="allow listening beyond loopback with no API key configured (anyone "
                           "who reaches the port can use the API)")
    # --tls-dir & co. (TLSSettings) are the gateway's identity towards the scheduler; clients see another.
    scheduler_server_name: str = Field("stepwire-scheduler", description="with TLS: the name the scheduler's "
                                       "certificate carries")
    public_tls_cert: str = Field("", description="certificate (PEM) for clients, on the HTTP and gRPC ports; "
                                 "empty: plaintext to clients (TLS ends at an ingress, say)")
    public_tls_key: str = Field("", description="its private key (PEM)")
    reuse_port: bool = Field(False, description="share --port and --grpc-address with other gateway processes on "
                             "this host (SO_REUSEPORT): the kernel spreads new connections between them. Off, a port "
                             "already taken is an error. `stepwire serve --gateway-workers` sets it")

    @model_validator(mode="after")
    def _public_pair(self):
        if bool(self.public_tls_cert) != bool(self.public_tls_key):
            raise ValueError("TLS for clients needs both --public-tls-cert and --public-tls-key")
        return self
