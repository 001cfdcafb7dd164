"""`stepwire serve` as a supervisor: its services never outlive it, whatever way it dies, and it keeps each
of them up, the gateway included."""

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from helpers import command_words, free_ports, runs_service, wait_http_ready, wait_until
from shallow_model import SHALLOW, shallow_model

from launcher import local_stack
from launcher.local_stack import Child, ServeSettings
from stepwire.contract.settings import load

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody has reaped yet (a container's init may never)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier} - found
        found |= frontier
    return found


def test_a_tethered_child_dies_with_its_parent_even_when_the_parent_is_killed_with_sigkill(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from launcher.tethered import ProcessGroup
        child = ProcessGroup().popen({SLEEPER!r})
        print(child.pid, flush=True)
        time.sleep(600)
        """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert alive(child) and os.getpgid(child) == child != os.getpgid(parent.pid)   # a group of its own
    parent.kill()
    parent.wait()
    wait_until(lambda: not alive(child), 10, "the orphan to get its parent-death signal")


def test_a_failure_of_serves_own_stops_every_service_and_what_they_started(monkeypatch, tmp_path):
    # Each service starts a grandchild that ignores SIGTERM: only the group's SIGKILL reaches it.
    stubborn = textwrap.dedent("""
        import pathlib, subprocess, sys, time
        gc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                               "signal.SIG_IGN); time.sleep(600)"])
        pathlib.Path(sys.argv[1]).write_text(str(gc.pid))
        time.sleep(600)
        """)
    everyone = [Child(f"service-{i}", [sys.executable, "-c", stubborn, str(tmp_path / f"gc-{i}")])
                for i in range(3)]
    calls = []

    def broken_health_check(url):
        calls.append(url)
        if len(calls) == 3:
            raise RuntimeError("a bug in serve")
        return False

    monkeypatch.setattr(local_stack, "_healthy", broken_health_check)
    with pytest.raises(RuntimeError, match="a bug in serve"):
        local_stack.supervise(load(ServeSettings, ["--port", "1"]), everyone)
    assert all(c.proc.poll() is not None for c in everyone)
    grandchildren = [int((tmp_path / f"gc-{i}").read_text()) for i in range(3)]
    wait_until(lambda: not any(map(alive, grandchildren)), 10, "the group's SIGKILL to reach the grandchildren")


def _serve(tmp_path: Path, *flags: str, api_key: str) -> tuple[subprocess.Popen, str, dict]:
    """serve on the embedded model's first layers (conftest.shallow): what is asserted here is supervision, and
    the requests that keep the stack busy cost a third as much."""
    if not (MODEL / "conversion.json").exists():
        pytest.skip("embedded model not converted (make model)")
    pytest.importorskip("torch")
    model = shallow_model()
    http, grpc_port, sc, ex, m1, m2 = free_ports(6)
    serve = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "serve", "--model", str(model), "--port", str(http),
         "--grpc-port", str(grpc_port), "--scheduler-port", str(sc), "--executor-port", str(ex),
         "--kv-cache-memory", str(32 << 20), "--scheduler-metrics-port", str(m1), "--executor-metrics-port",
         str(m2), *flags], cwd=ROOT, stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT,
        env=os.environ | {"STEPWIRE_API_KEY": api_key}, process_group=0)     # a group of its own, as under a shell
    url = f"http://127.0.0.1:{http}"
    wait_http_ready(url, {"serve": serve}, logs=[tmp_path / "serve.log"])
    wait_until(lambda: "stepwire is ready" in (tmp_path / "serve.log").read_text(), 60, "the ready message",
               procs={"serve": serve}, logs=[tmp_path / "serve.log"])
    return serve, url, {"Authorization": f"Bearer {api_key}"}


def _complete(url: str, headers: dict) -> str:
    body = {"model": SHALLOW.name, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("tls, method", [([], "fork"), (["--no-tls"], "exec")], ids=["mtls-fork", "plaintext-exec"])
def test_serve_with_an_api_key_announces_the_model_and_its_services_die_with_it_on_sigkill(tmp_path, tls, method):
    serve, url, key = _serve(tmp_path, *tls, "--start-method", method, api_key="sk-supervised")
    try:
        # The ready message reads the model list with the key: before, it got a 401 and serve died there.
        assert f"(model '{SHALLOW.name}')" in (tmp_path / "serve.log").read_text()
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        _complete(url, key)
        services = descendants(serve.pid)
        # executor, scheduler, gateway (and whatever they started), each showing the command that starts it
        assert all(any(runs_service(p, kind) for p in services) for kind in ("executor", "scheduler", "gateway"))
        servers = [p for p in services if "multiprocessing.forkserver" in " ".join(command_words(p))]
        assert len(servers) == (method == "fork")
    finally:
        serve.kill()
        serve.wait()
    wait_until(lambda: not any(map(alive, services)), 60, "every service to stop after serve was killed")
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)


def test_serve_starts_a_gateway_that_exits_again_and_stops_everything_on_sigterm(tmp_path):
    serve, url, key = _serve(tmp_path, api_key="sk-supervised")
    try:
        first = _complete(url, key)
        gateway = next(p for p in descendants(serve.pid) if runs_service(p, "gateway"))
        services = descendants(serve.pid)
        os.kill(gateway, signal.SIGKILL)
        wait_until(lambda: not alive(gateway), 10, "the gateway to die")
        wait_until(lambda: _up(url), 90, "a new gateway", procs={"serve": serve}, logs=[tmp_path / "serve.log"])
        assert _complete(url, key) == first
        assert serve.poll() is None
        assert "gateway exited with -9; starting it again" in (tmp_path / "serve.log").read_text()
        services = (services | descendants(serve.pid)) - {gateway}
    finally:
        # To serve's whole group, as timeout(1) or systemd send it: serve's helpers (the fork server) must not
        # die of it and take the services down before serve stops them in order.
        os.killpg(serve.pid, signal.SIGTERM)
        code = serve.wait(timeout=90)
    assert code == 0   # serve waited for every service: none is left running
    assert not [p for p in services if alive(p)]
    assert "executor stopped" in (tmp_path / "serve.log").read_text()     # drained, not killed


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def listeners(port: int) -> int:
    """Listening sockets on loopback `port`: each gateway worker has its own (SO_REUSEPORT)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        count += sum(1 for r in rows if r.split()[3] == "0A" and int(r.split()[1].rsplit(":", 1)[1], 16) == port)
    return count


def _gateways(serve: subprocess.Popen) -> list[int]:
    return [p for p in descendants(serve.pid) if alive(p) and runs_service(p, "gateway")]


def test_gateway_workers_share_the_port_and_one_killed_leaves_it_answering_every_request(tmp_path):
    serve, url, key = _serve(tmp_path, "--gateway-workers", "2", api_key="sk-supervised")
    try:
        gateways = _gateways(serve)
        assert len(gateways) == 2
        first = _complete(url, key)
        # Each request on a new connection: the kernel spreads them over both workers.
        assert [_complete(url, key) for _ in range(6)] == [first] * 6
        port = int(url.rsplit(":", 1)[1])
        assert listeners(port) == 2
        os.kill(gateways[0], signal.SIGKILL)
        # Its socket, and the connections the kernel queued on it, go only when its last thread has exited, which
        # can be after its main thread already shows as a zombie: a request sent in between is reset.
        wait_until(lambda: not alive(gateways[0]) and listeners(port) == 1, 10,
                   "the gateway worker and its socket to go")
        # The other worker takes every new connection, and the one serve starts again joins the port only
        # once it is ready: no request meets a refused connection or a "not ready".
        log = tmp_path / "serve.log"
        listening = lambda: log.read_text().count("stepwire.gateway INFO gateway for")   # noqa: E731
        assert listening() == 2
        answers = []
        while listening() < 3:
            answers.append(_complete(url, key))
            assert len(answers) < 5000, "serve did not start the gateway worker again"
        answers += [_complete(url, key) for _ in range(10)]
        assert set(answers) == {first} and len(_gateways(serve)) == 2
        assert re.search(r"gateway-[01] exited with -9; starting it again", log.read_text())
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=90)
    assert code == 0
