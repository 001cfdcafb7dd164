"""`stepwire serve`: how it lays out its executors, and that it keeps them up."""

import os
import sys
import time
from pathlib import Path

import pytest

from launcher.local_stack import Child, ServeSettings, certificates, children, keep_up
from launcher.processes import MODULE
from launcher.tethered import ProcessGroup
from stepwire.contract.settings import load

pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def _flag(command, name):
    return command[command.index(name) + 1]


def test_serve_gives_each_executor_its_own_port_and_a_share_of_the_cores():
    cores = len(os.sched_getaffinity(0))
    executors, stack = children(load(ServeSettings, ["--executors", "3", "--executor-port", "6000"]))
    assert [_flag(c.command, "--address") for c in executors] == ["127.0.0.1:6000", "127.0.0.1:6001",
                                                                  "127.0.0.1:6002"]
    assert {_flag(c.command, "--threads") for c in executors} == {str(max(1, cores // 3))}
    assert len({_flag(c.command, "--metrics-address") for c in executors}) == 3
    scheduler = next(c for c in stack if c.name == "scheduler")
    assert _flag(scheduler.command, "--executors") == "127.0.0.1:6000,127.0.0.1:6001,127.0.0.1:6002"
    # One executor keeps torch's own default; an explicit count wins.
    assert _flag(children(load(ServeSettings, []))[0][0].command, "--threads") == "0"
    assert _flag(children(load(ServeSettings, ["--executors", "2", "--threads", "5"]))[0][1].command,
                 "--threads") == "5"
    # Tensor-parallel executors: every rank of every executor gets its share.
    (one,), _ = children(load(ServeSettings, ["--tensor-parallel-size", "2"]))
    assert _flag(one.command, "--tensor-parallel-size") == "2"
    assert _flag(one.command, "--threads") == str(max(1, cores // 2))
    # Deterministic mode reaches every executor, and only when asked for.
    assert "--deterministic" not in one.command
    assert all("--deterministic" in c.command
               for c in children(load(ServeSettings, ["--executors", "2", "--deterministic"]))[0])
    # So does the weights' quantization.
    assert _flag(one.command, "--quantization") == "auto"
    assert {_flag(c.command, "--quantization")
            for c in children(load(ServeSettings, ["--executors", "2", "--quantization", "gguf"]))[0]} == {"gguf"}


def test_serve_splits_its_executors_into_prefill_and_decode_only_when_asked_and_keeps_one_of_each():
    assert {_flag(c.command, "--role") for c in children(load(ServeSettings, ["--executors", "2"]))[0]} == {"mixed"}
    executors, _ = children(load(ServeSettings, ["--executors", "3", "--prefill-executors", "1"]))
    assert [_flag(c.command, "--role") for c in executors] == ["prefill", "decode", "decode"]
    with pytest.raises(SystemExit, match="leaves none"):
        children(load(ServeSettings, ["--executors", "2", "--prefill-executors", "2"]))


def test_serve_forks_its_services_unless_asked_not_to_or_an_nvidia_device_is_there(monkeypatch):
    from launcher import local_stack

    def method(flag: str, devices: list[str]) -> set[bool]:
        monkeypatch.setattr(local_stack.glob, "glob", lambda pattern: devices)
        executors, stack = children(load(ServeSettings, ["--start-method", flag]))
        return {c.fork for c in executors + stack}

    assert method("auto", []) == {True} and method("auto", ["/dev/nvidia0"]) == {False}
    assert method("fork", ["/dev/nvidia0"]) == {True} and method("exec", []) == {False}
    with pytest.raises(SystemExit):
        load(ServeSettings, ["--start-method", "spawn"])


def test_a_certs_folder_from_before_roles_is_made_again_and_a_current_one_is_kept(tmp_path):
    from security.identity import ROLES, role_of

    (tmp_path / "ca.crt").write_text("a CA whose certificates name no role")
    d, temporary = certificates(load(ServeSettings, ["--certs-dir", str(tmp_path)]))
    assert d == tmp_path and temporary is None
    assert all(role_of((d / r / "tls.crt").read_bytes(), "stepwire.local") == r for r in ROLES)
    ca = (d / "ca.crt").read_bytes()
    certificates(load(ServeSettings, ["--certs-dir", str(tmp_path)]))
    assert (d / "ca.crt").read_bytes() == ca


def test_an_executor_that_exits_is_started_again_and_one_that_keeps_dying_waits_longer_each_time():
    c, group = Child("executor-0", [sys.executable, "-c", "import sys; sys.exit(3)"], pause=0.05), ProcessGroup()
    c.start(group)
    pauses = []
    deadline = time.monotonic() + 20
    while c.restarts < 3 and time.monotonic() < deadline:
        keep_up(c, group)
        if c.died_at is not None and (not pauses or pauses[-1] != c.pause):
            pauses.append(c.pause)
        time.sleep(0.05)
    assert c.restarts == 3
    assert pauses == sorted(pauses) and pauses[-1] > pauses[0]     # backs off while it dies young
    c.proc.wait()


def test_a_service_killed_from_outside_is_started_again_after_a_second_however_young_it_died():
    # A SIGKILL is an operator's, the OOM killer's or a chaos test's, not a crash loop of its own: a growing pause
    # there once left both gateway workers down for longer than a stream's resume grace period.
    c, group = Child("gateway-0", [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                     pause=4.0), ProcessGroup()
    c.start(group)
    c.proc.wait()
    keep_up(c, group)
    assert c.died_at is not None and c.pause == 1.0


def _pid_of(*words: str) -> int:
    """The process whose command line holds every one of `words`."""
    from pathlib import Path

    from helpers import command_words

    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = command_words(int(proc.name))
        except OSError:
            continue
        if all(w in cmd for w in words):
            return int(proc.name)
    raise AssertionError(f"no process with {words}")


def test_serve_restarts_a_killed_executor_and_keeps_serving_meanwhile(tmp_path):
    import signal
    import subprocess
    from pathlib import Path

    import httpx
    import pytest

    grpc = pytest.importorskip("grpc")
    pytest.importorskip("torch")
    from helpers import free_port_runs, free_ports, wait_http_ready, wait_until

    from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc

    root = Path(__file__).resolve().parent.parent
    model = root / "models" / "SmolLM2-135M-Instruct"
    if not (model / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    http, grpc_port, sc, m1 = free_ports(4)
    ex, m2 = free_port_runs(2, 2)     # two executors: ex and ex + 1, metrics m2 and m2 + 1
    log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "serve", "--model", str(model), "--executors", "2", "--port", str(http),
         "--grpc-port", str(grpc_port), "--scheduler-port", str(sc), "--executor-port", str(ex),
         "--kv-cache-memory", str(64 << 20), "--scheduler-metrics-port", str(m1), "--executor-metrics-port", str(m2),
         "--certs-dir", str(tmp_path / "certs")],
        cwd=root, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{http}"
        wait_http_ready(url, {"serve": serve}, logs=[tmp_path / "serve.log"])
        # The local stack is mTLS inside: plaintext is refused, and Stats answers the operator's certificate.
        with pytest.raises(grpc.RpcError):
            scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(f"127.0.0.1:{sc}")).Stats(
                scheduler_pb2.StatsRequest(), timeout=5)
        me = tmp_path / "certs" / "operator"
        creds = grpc.ssl_channel_credentials((me / "ca.crt").read_bytes(), (me / "tls.key").read_bytes(),
                                             (me / "tls.crt").read_bytes())
        stub = scheduler_pb2_grpc.SchedulerStub(grpc.secure_channel(
            f"127.0.0.1:{sc}", creds, options=[("grpc.ssl_target_name_override", "stepwire-scheduler")]))
        connected = lambda: sorted(e.address for e in stub.Stats(scheduler_pb2.StatsRequest()).executors
                                   if e.connected)
        both = [f"127.0.0.1:{ex}", f"127.0.0.1:{ex + 1}"]
        wait_until(lambda: connected() == both, 60, "both executors to connect")
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

        os.kill(_pid_of(MODULE["executor"], f"127.0.0.1:{ex}"), signal.SIGKILL)
        # The other executor answers meanwhile, the same text; the stack stays up.
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == first
        wait_until(lambda: connected() == both, 90, "the killed executor to be started again and rejoin",
                   procs={"serve": serve}, logs=[tmp_path / "serve.log"])
        assert serve.poll() is None
        assert "executor-0 exited with -9; starting it again" in (tmp_path / "serve.log").read_text()

        # The scheduler too: the gateway holds the request until the new one serves, and resubmits it.
        os.kill(_pid_of(MODULE["scheduler"], f"127.0.0.1:{sc}"), signal.SIGKILL)
        assert httpx.post(url + "/v1/completions", json=body, timeout=90).json()["choices"][0]["text"] == first
        assert serve.poll() is None
        assert "scheduler exited with -9; starting it again" in (tmp_path / "serve.log").read_text()
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
        log.close()
    # An executor and a scheduler lost and an ordinary stop: one line for each fault, no traceback.
    text = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in text and "aclose()" not in text and "Task was destroyed" not in text


def test_serve_takes_a_gguf_file_converts_it_once_and_serves_its_quantized_weights(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from test_gguf_quantized_model import MIXED, write_gguf

    from launcher.local_stack import served_models

    gguf = write_gguf(tmp_path / "Tiny-Q4.gguf", MIXED)
    monkeypatch.setenv("STEPWIRE_MODEL_CACHE", str(tmp_path / "cache"))
    (m,) = served_models(load(ServeSettings, ["--model", str(gguf)]))
    assert m.path == str(tmp_path / "cache" / "Tiny-Q4") and m.quantization == "gguf" and m.name == "Tiny-Q4"
    assert (Path(m.path) / "quantized.safetensors").is_file()
    made = (Path(m.path) / "model.safetensors").stat().st_mtime_ns
    (again,) = served_models(load(ServeSettings, ["--model", str(gguf), "--quantization", "none"]))
    assert again.quantization == "none" and (Path(m.path) / "model.safetensors").stat().st_mtime_ns == made
    (plain,) = served_models(load(ServeSettings, ["--model", str(tmp_path / "a-directory")]))
    assert plain.path == str(tmp_path / "a-directory") and plain.quantization == "auto"
    with pytest.raises(SystemExit, match="not found"):
        served_models(load(ServeSettings, ["--model", str(tmp_path / "missing.gguf")]))


def test_serve_beside_a_process_holding_its_port_starts_nothing_and_names_the_port_the_flag_and_the_holder(tmp_path):
    import socket
    import subprocess
    from pathlib import Path

    from helpers import free_ports

    root = Path(__file__).resolve().parent.parent
    http, grpc_port, sc, m1, ex, m2 = free_ports(6)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", grpc_port))
        holder.listen()
        done = subprocess.run(
            [sys.executable, "-m", "launcher.cli", "serve", "--model", str(tmp_path / "no-model"), "--port", str(http),
             "--grpc-port", str(grpc_port), "--scheduler-port", str(sc), "--executor-port", str(ex),
             "--scheduler-metrics-port", str(m1), "--executor-metrics-port", str(m2)],
            cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"port {grpc_port} is taken" in done.stderr and "--grpc-port" in done.stderr
    assert f"held by pid {os.getpid()}" in done.stderr
    assert "nothing was started" in done.stderr and "starting it again" not in done.stderr


def test_serve_hands_the_reasoning_and_tool_call_parsers_to_every_gateway():
    _, stack = children(load(ServeSettings, ["--gateway-workers", "2", "--reasoning-parser", "qwen3",
                                             "--tool-call-parser", "mistral"]))
    gateways = [c for c in stack if c.name.startswith("gateway")]
    assert len(gateways) == 2
    assert all(_flag(g.command, "--reasoning-parser") == "qwen3" for g in gateways)
    assert all(_flag(g.command, "--tool-call-parser") == "mistral" for g in gateways)
    _, stack = children(load(ServeSettings, []))   # auto: the gateway's own default, not passed
    assert "--reasoning-parser" not in next(c for c in stack if c.name == "gateway").command
