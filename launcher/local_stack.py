"""`stepwire serve`: the whole stack on localhost, as one process per service, kept up.

Every service is kept up: one that exits is started again on the same address, with a growing pause if it
keeps dying at start-up. An executor's requests move to the others meanwhile; the gateway holds its
clients' streams while the scheduler is away; a restarted gateway loses only the streams it held.

The services cannot outlive serve (`tethered.py`): they die with it however it dies, kill -9 included, and
any failure of serve's own ends in a clean stop of all of them.

The host's cores are split between the executors (`--threads`), since each would otherwise start a thread
per core and they would fight over them.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import httpx
from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from gateway.text.reasoning import PARSERS as REASONING_PARSERS
from gateway.text.tool_family import PARSERS as TOOL_CALL_PARSERS
from launcher.announce import announce
from launcher.forked import Forked, stop_server
from launcher.port_check import taken_ports
from launcher.processes import Service, command, fork
from launcher.tethered import ProcessGroup
from stepwire.contract.settings import ServiceSettings, comma_separated, load

log = logging.getLogger("stepwire.serve")
STOP_SECONDS = 30.0   # for the services to stop on SIGTERM (an executor drains first) before they are killed


class ServeSettings(ServiceSettings):
    """Start executors, scheduler and gateway on localhost. Every flag is also STEPWIRE_SERVE_<FLAG>."""

    model_config = SettingsConfigDict(env_prefix="STEPWIRE_SERVE_", cli_prog_name="stepwire serve")

    model: Annotated[list[str], NoDecode] = Field(
        ["models/SmolLM2-135M-Instruct"], min_length=1, max_length=16, description="Hugging Face model directory, "
        "or a GGUF file (converted once into a directory, its quantized weights served as they are). Given more "
        "than once (or comma-separated), several models behind one gateway, each named by its directory and with "
        "its own scheduler (on --scheduler-port and up) and --executors executors (docs/multimodel.md)")
    port: int = Field(8000, description="HTTP port of the gateway")
    grpc_port: int = Field(50050, description="gRPC port of the gateway (stepwire.v1)")
    scheduler_port: int = Field(50051)
    executors: int = Field(1, ge=1, description="local executors; they take ports from --executor-port up")
    gateway_workers: int = Field(1, ge=1, le=64, description="gateway processes sharing --port and --grpc-port "
                                 "(SO_REUSEPORT): one process streams at most about 15-17k tokens a second; "
                                 "each serves its own /metrics")
    prefill_executors: int = Field(0, ge=0, description="of --executors, how many prefill (--role prefill; the "
                                   "first ones); the others then decode (--role decode). 0: every executor mixed")
    executor_port: int = Field(50061, description="port of the first executor")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks per executor (processes that split the model)")
    threads: int = Field(0, ge=0, description="torch threads per executor rank; 0: the host's cores split evenly "
                         "between all ranks of all executors")
    kv_cache_memory: int = Field(1 << 30, ge=1, description="bytes for each executor's KV cache")
    deterministic: bool = Field(False, description="executors with batch-invariant kernels: the same tokens in "
                                "any batch, chunking or executor, in bfloat16 as in float32 (docs/operations.md)")
    speculative_method: Literal["none", "ngram", "draft"] = Field(
        "none", description="executors' speculative decoding: ngram (prompt lookup) or draft (--speculative-model), "
        "verified in one pass; greedy and seeded output unchanged (docs/speculative_decoding.md)")
    speculative_model: str = Field("", description="draft: a small model directory with the target's tokenizer")
    speculative_quantization: Literal["none", "auto", "fp8", "gguf", "int8", "int4"] = Field(
        "auto", description="the draft model's weights, as --quantization")
    quantization: Literal["none", "auto", "fp8", "gguf", "int8", "int4"] = Field(
        "auto", description="the executors' weights: auto takes gguf on float32 CPU executors where the directory "
        "holds quantized weights, else none; gguf (CPU) multiplies the Q4_0/Q4_1/Q8_0 blocks of the GGUF "
        "the model directory was converted from as they are (docs/quantized.md); int8 and int4 (CPU) quantize a "
        "float checkpoint at load into Q8_0, or Q4_1 with the embedding and head in Q8_0; fp8 (CUDA) quantizes "
        "at load")
    num_speculative_tokens: int = Field(8, ge=1, le=16, description="most tokens a request verifies per step")
    max_loras: int = Field(0, ge=0, le=256, description="executors' LoRA adapter slots (0: no adapters; "
                           "docs/lora.md)")
    max_lora_rank: int = Field(16, ge=1, le=512, description="the largest adapter rank a slot takes")
    lora_modules: str = Field("", description="adapters served from the start, comma-separated name=path "
                              "(needs --max-loras); more are loaded through POST /v1/load_lora_adapter")
    lora_dir: str = Field("", description="executors read adapters only from inside this directory; empty: any "
                          "path")
    tenants_file: str = Field("", description="the gateway's tenants: API keys and weights in the scheduler's fair "
                              "sharing (docs/tenants.md)")
    reasoning_parser: Literal[REASONING_PARSERS] = Field(
        "auto", description="the gateway's --reasoning-parser: how a model's reasoning is told from its answer "
        "(docs/reasoning.md)")
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = Field(
        "auto", description="the gateway's --tool-call-parser: the format of tool_choice \"auto\" calls "
        "(docs/tool_calling.md)")
    scheduler_metrics_port: int = Field(9091, description="Prometheus /metrics of the scheduler")
    executor_metrics_port: int = Field(9092, description="Prometheus /metrics of the first executor (then +1)")
    tls: bool = Field(True, description="mTLS between the services, with a development CA (--no-tls: plaintext "
                      "on loopback)")
    start_method: Literal["auto", "fork", "exec"] = Field(
        "auto", description="fork: services fork from a server that imported them once (a start or restart takes a "
        "fifth of the time or less, and they share the imported code's memory); exec: each starts as a new "
        "process; auto: fork unless the host has an NVIDIA device")
    certs_dir: str = Field("", description="where `stepwire certs` wrote (or will write) the certificates; "
                           "empty: a fresh CA in a temporary folder, removed on exit")

    @field_validator("model", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        return comma_separated(value)

    @field_validator("model")
    @classmethod
    def _distinct_names(cls, value):
        names = [model_name(m) for m in value]
        if len(set(names)) != len(names):
            raise ValueError("two models of one name: each model is named by its directory (or GGUF file)")
        return value


def model_name(path: str) -> str:
    """The name clients use for a model serve starts: its directory's (a GGUF file's, without .gguf)."""
    p = Path(path.rstrip("/"))
    return p.stem if p.suffix.lower() == ".gguf" else p.name


@dataclass
class Child:
    name: str
    command: list[str]
    service: Service | None = None      # with fork: started by forking, as `command` would start it
    fork: bool = False
    proc: subprocess.Popen | Forked | None = None
    started_at: float = 0.0
    restarts: int = 0
    died_at: float | None = None
    pause: float = 0.5          # before the next restart; doubles while it keeps dying young

    def start(self, group: ProcessGroup) -> None:
        if isinstance(self.proc, Forked):       # the one before, which exited
            group.leave(self.proc.pid)
        if self.fork and self.service is not None:
            self.proc = fork(self.service, group, env=dict(os.environ), log=None, cwd=os.getcwd())
        else:
            self.proc = group.popen(self.command)
        self.started_at = time.monotonic()

    def exited(self) -> int | None:
        return self.proc.poll()


def forks(a: ServeSettings) -> bool:
    # CUDA does not survive a fork of a process that started it, and which imports start it is not ours to
    # promise on every driver: where an NVIDIA device is, each service starts anew.
    return a.start_method == "fork" or (a.start_method == "auto" and not glob.glob("/dev/nvidia[0-9]*"))


def threads_per_executor(a: ServeSettings) -> int:
    if a.threads:
        return a.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = a.executors * a.tensor_parallel_size * len(a.model)
    return 0 if ranks == 1 else max(1, cores // ranks)


def role_of(a: ServeSettings, i: int) -> str:
    if not a.prefill_executors:
        return "mixed"
    if a.prefill_executors >= a.executors:
        raise SystemExit(f"stepwire serve: --prefill-executors {a.prefill_executors} leaves none of --executors "
                         f"{a.executors} to decode")
    return "prefill" if i < a.prefill_executors else "decode"


@dataclass
class ServedModel:
    name: str             # what clients put in `model`
    path: str             # its directory
    quantization: str     # the executors' --quantization


def scheduler_metrics_port(a: ServeSettings, i: int) -> int:
    """The first model's scheduler serves /metrics on --scheduler-metrics-port; the others' on the ports after
    every executor's."""
    return a.scheduler_metrics_port if i == 0 else a.executor_metrics_port + len(a.model) * a.executors + i - 1


def children(a: ServeSettings, certs: Path | None = None, models: list[ServedModel] | None = None,
             models_file: Path | None = None) -> tuple[list[Child], list[Child]]:
    """(executors, the rest) as commands, built as every test's stack builds them (processes.py), each with its
    own certificate from `certs` (a `stepwire certs` folder) when given. `models`: what each --model is served
    as (GGUF files converted; `served_models`); several need `models_file`, which the gateways read."""

    def child(kind: str, name: str, flags: dict) -> Child:
        tls = {"--tls-dir": certs / kind} if certs is not None else {}
        service = Service(kind, name, flags | tls)
        return Child(name, command(service), service, fork)

    fork = forks(a)
    models = models or [ServedModel(model_name(m), m, a.quantization) for m in a.model]
    several = len(models) > 1
    threads = threads_per_executor(a)
    executors, schedulers, entries = [], [], []
    for m, model in enumerate(models):
        first = m * a.executors
        addresses = [f"127.0.0.1:{a.executor_port + first + i}" for i in range(a.executors)]
        sc = f"127.0.0.1:{a.scheduler_port + m}"
        executors += [child("executor", f"executor-{first + i}", {
            "--model": model.path, "--address": address, "--kv-cache-memory": a.kv_cache_memory,
            "--threads": threads, "--tensor-parallel-size": a.tensor_parallel_size,
            "--deterministic": a.deterministic, "--role": role_of(a, i),
            "--metrics-address": f"127.0.0.1:{a.executor_metrics_port + first + i}",
            "--speculative-method": a.speculative_method, "--num-speculative-tokens": a.num_speculative_tokens,
            "--speculative-model": a.speculative_model or None,
            "--speculative-quantization": a.speculative_quantization, "--max-loras": a.max_loras,
            "--max-lora-rank": a.max_lora_rank, "--lora-dir": a.lora_dir or None,
            "--quantization": model.quantization})
            for i, address in enumerate(addresses)]
        schedulers.append(child("scheduler", f"scheduler-{m}" if several else "scheduler", {
            "--executors": ",".join(addresses), "--address": sc,
            "--metrics-address": f"127.0.0.1:{scheduler_metrics_port(a, m)}",
            "--lora-modules": a.lora_modules or None,
            "--served-model": Path(model.path).name if several else None}))
        entries.append({"name": model.name, "model": model.path, "scheduler": sc})
    if several:
        if models_file is None:
            raise ValueError("several models need a models file for the gateways")
        models_file.write_text(json.dumps({"models": entries}, indent=2))
        route = {"--models-file": models_file}
    else:
        route = {"--model": models[0].path, "--scheduler": entries[0]["scheduler"]}
    stack = [
        *schedulers,
        *(child("gateway", "gateway" if a.gateway_workers == 1 else f"gateway-{i}", route | {
            "--port": a.port, "--grpc-address": f"127.0.0.1:{a.grpc_port}",
            "--tenants-file": a.tenants_file or None, "--reuse-port": a.gateway_workers > 1,
            "--reasoning-parser": None if a.reasoning_parser == "auto" else a.reasoning_parser,
            "--tool-call-parser": None if a.tool_call_parser == "auto" else a.tool_call_parser})
          for i in range(a.gateway_workers)),
    ]
    return executors, stack


def certificates(a: ServeSettings) -> tuple[Path | None, Path | None]:
    """(the certificates' folder, a temporary folder to remove on exit); the CA is made if there is none."""
    if not a.tls:
        return None, None
    from security.dev_certs import make_dev_certs

    if a.certs_dir:
        d = Path(a.certs_dir)
        # A folder from before certificates named their roles has no operator: every peer would refuse them.
        if not (d / "operator" / "tls.crt").exists():
            make_dev_certs(d)
        return d, None
    d = Path(tempfile.mkdtemp(prefix="stepwire-certs-"))
    return make_dev_certs(d), d


class Stop(Exception):
    """SIGTERM or SIGINT reached serve."""


def served_models(a: ServeSettings) -> list[ServedModel]:
    """Each --model as serve starts it. A GGUF file is converted once (tools.convert_gguf, which redoes nothing
    already done) into a model directory under STEPWIRE_MODEL_CACHE (default ~/.cache/stepwire/models), served
    from there, and with its own quantized weights unless --quantization says otherwise."""
    out = []
    for path in a.model:
        gguf = Path(path)
        if gguf.suffix.lower() != ".gguf":
            out.append(ServedModel(model_name(path), path, a.quantization))
            continue
        try:
            from tools.convert_gguf import ConversionError, convert
        except ImportError as e:
            sys.exit(f"stepwire serve: converting {gguf.name} needs the convert extra (pip install "
                     f"'stepwire[convert]'): {e}")
        cache = Path(os.environ.get("STEPWIRE_MODEL_CACHE") or Path.home() / ".cache" / "stepwire" / "models")
        try:
            directory = convert(gguf, cache / gguf.stem)
        except ConversionError as e:
            sys.exit(f"stepwire serve: {e}")
        quantization = a.quantization if "quantization" in a.model_fields_set else "gguf"
        log.info("serving %s from %s (--quantization %s)", gguf.name, directory, quantization)
        out.append(ServedModel(model_name(path), str(directory), quantization))
    return out


def ports_of(a: ServeSettings) -> list[tuple[int, str]]:
    """Every port serve's services listen on, with the flag that moves it."""
    out = [(a.port, "--port"), (a.grpc_port, "--grpc-port")]
    for m in range(len(a.model)):
        out += [(a.scheduler_port + m, "--scheduler-port"), (scheduler_metrics_port(a, m), "--scheduler-metrics-port")]
    for i in range(a.executors * len(a.model)):
        out += [(a.executor_port + i, "--executor-port"), (a.executor_metrics_port + i, "--executor-metrics-port")]
    return out


def shared_ports(ports: list[tuple[int, str]]) -> dict[int, tuple[str, str]]:
    """Ports two of serve's own services would both listen on (the port flags overlap), with the two flags."""
    first: dict[int, str] = {}
    shared = {}
    for port, flag in ports:
        if port in first and port not in shared:
            shared[port] = (first[port], flag)
        first.setdefault(port, flag)
    return shared


def serve(argv: list[str]) -> None:
    a = load(ServeSettings, argv)
    logging.basicConfig(level=logging.INFO, format="stepwire: %(message)s")
    ports = ports_of(a)
    taken = [f"port {p} is given to both {flags[0]} and {flags[1]}" for p, flags in shared_ports(ports).items()]
    taken = taken or taken_ports(ports)
    if taken:
        for line in taken:
            log.error("%s", line)
        log.error("nothing was started")
        sys.exit(2)
    logging.getLogger("httpx").setLevel(logging.WARNING)   # not a line per health poll
    models = served_models(a)
    certs, temporary = certificates(a)
    work = Path(tempfile.mkdtemp(prefix="stepwire-serve-"))
    executors, stack = children(a, certs, models, work / "models.json")

    def on_signal(signum, _frame):
        raise Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 1
    try:
        supervise(a, executors + stack, certs=certs)
    except Stop:
        code = 0
    except Exception:
        log.exception("serve failed; stopping every service")
    finally:
        stop_server()       # after the services: the fork server is this process's last child
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(code)


def supervise(a: ServeSettings, everyone: list[Child], group: ProcessGroup | None = None,
              certs: Path | None = None) -> None:
    """Start every service and keep each up until a signal or a failure of serve's own, which end here in
    a stop of all of them, whatever the exception."""
    group = group or ProcessGroup()
    url = f"http://127.0.0.1:{a.port}"
    ready = False
    try:
        for c in everyone:
            c.start(group)
        while True:
            for c in everyone:
                keep_up(c, group)
            if not ready:
                ready = _healthy(url)
                if ready:
                    announce(a, url, certs, [scheduler_metrics_port(a, m) for m in range(len(a.model))])
            time.sleep(0.5 if not ready else 1)
    except Stop as e:
        log.info("%s: stopping every service", e)
        raise
    finally:
        # A second Ctrl-C (or SIGTERM) while the services drain kills them at once.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: group.signal(signal.SIGKILL))
        stop_all(everyone, group)


def stop_all(everyone: list[Child], group: ProcessGroup, seconds: float = STOP_SECONDS) -> None:
    """SIGTERM to the services in the reverse of their start order, each kind once the kind after it has
    stopped (the gateway's streams end while the scheduler still serves them, and the scheduler tells its
    executors while they still listen); up to `seconds` in all, then SIGKILL to whatever is left in the
    group (services that did not stop, and what they started)."""
    deadline = time.monotonic() + seconds
    kinds: dict[str, list[Child]] = {}
    for c in everyone:
        kinds.setdefault(c.name.split("-")[0], []).append(c)
    for kind in reversed(kinds.values()):
        running = [c for c in kind if c.proc is not None and c.proc.poll() is None]
        for c in running:
            c.proc.terminate()
        for c in running:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs of SIGTERM; killing it", c.name, seconds)
    group.signal(signal.SIGKILL)
    for c in everyone:
        if c.proc is not None:
            c.proc.wait()


def keep_up(c: Child, group: ProcessGroup) -> None:
    """Start a service again once it has exited, after a pause that grows while it dies young."""
    code = c.exited()
    if code is None:
        return
    if c.died_at is None:
        c.died_at = time.monotonic()
        # A crash loop backs off; a SIGKILL from outside (an operator, the OOM killer, a chaos test) is no loop of
        # its own, and a growing pause there left every gateway worker down for longer than a stream's grace.
        young = c.died_at - c.started_at < 10 and code != -signal.SIGKILL
        c.pause = min(c.pause * 2, 30) if young else 1.0
        log.warning("%s exited with %s; starting it again in %.0fs", c.name, code, c.pause)
    if time.monotonic() - c.died_at >= c.pause:
        c.died_at = None
        c.restarts += 1
        c.start(group)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
