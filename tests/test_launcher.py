"""launcher/processes.py, the one way tests, benchmarks and `stepwire serve` start services: the command lines
it builds, and that each of a Stack's hooks does what it says."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import grpc_health, wait_until
from tiny_model import kv_bytes, write_tiny_llama

from launcher.processes import MODULE, Service, Stack, command, flag_dict, place

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`
# Members started as new processes (the benchmarks) and forked from the fork server (the tests' stacks): where the
# two differ (exit codes, groups, a parent's death); signals and restarts are the same os.kill either way.
modes = pytest.mark.parametrize("fork", [False, True], ids=["new-process", "forked"])


def executor(model: Path, name: str = "executor") -> Service:
    return Service("executor", name, {"--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(64),
                                      "--max-num-seqs": 8, "--max-model-len": 128, "--threads": 1})


def test_flags_become_a_command_line_and_a_stack_fills_in_ports_and_peers():
    assert flag_dict(["--a", "1", "--b", "--c", "", "--d", "-1"]) == {"--a": "1", "--b": True, "--c": "", "--d": "-1"}
    with pytest.raises(ValueError):
        flag_dict(["--a", "1", "2"])
    s = Service("scheduler", flags={"--address": "0.0.0.0:7", "--insecure": True, "--x": None, "--y": False})
    assert command(s) == [sys.executable, "-m", MODULE["scheduler"], "--address", "0.0.0.0:7", "--insecure"]
    assert s.name == "scheduler" and s.address == "127.0.0.1:7"
    ex = [Service("executor", f"executor-{i}") for i in range(2)]
    gateway, static = Service("gateway"), Service("scheduler")
    found = Service("scheduler", "found", ["--discovery", "dns"])
    place([*ex, static, gateway, found])
    assert static.flags["--executors"] == ",".join(e.address for e in ex) and "--executors" not in found.flags
    assert gateway.flags["--scheduler"] == static.address and gateway.url.startswith("http://127.0.0.1:")
    ports = [e.flags[f] for e in ex for f in ("--address", "--metrics-address")]
    assert len(set(ports)) == 4 and static.flags["--metrics-address"] not in ports


def test_kill_pause_resume_and_restart_one_member(launch, tmp_path):
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("torch")
    from grpc_health.v1 import health_pb2

    model = write_tiny_llama(tmp_path / "llama")
    stack = launch(executor(model), Service("scheduler", flags={"--metrics-address": "", "--retry-seconds": 0.2}))
    serving = health_pb2.HealthCheckResponse.SERVING
    address = stack["executor"].address
    with grpc.insecure_channel(stack["scheduler"].address) as sc, grpc.insecure_channel(address) as ex:
        assert grpc_health(sc) == serving and grpc_health(ex) == serving   # each waited for: both serve

        assert stack.kill("executor") == -signal.SIGKILL
        assert not stack.alive("executor") and stack.exited() == {}       # asked for: not a fault
        stack.wait_until(lambda: grpc_health(sc) == health_pb2.HealthCheckResponse.NOT_SERVING,
                         "the scheduler to miss its executor")
        stack.restart("executor")
        assert stack.alive("executor") and stack["executor"].address == address
        stack.wait_ready("executor")
        stack.wait_ready("scheduler")        # it found the executor again on its address

        stack.pause("scheduler")
        assert grpc_health(sc) is None and stack.alive("scheduler")     # frozen: it answers nothing
        stack.resume("scheduler")
        stack.wait_until(lambda: grpc_health(sc) == serving, "the scheduler to answer again")

        stack.terminate("scheduler")
        assert stack.wait("scheduler") == 0          # SIGTERM: a clean exit
        stack.start("scheduler")
        stack.wait_ready("scheduler")
    assert "start executor" in stack.log("executor").read_text()


@modes
def test_a_member_that_dies_on_its_own_fails_the_stack_with_its_log(tmp_path, fork):
    pytest.importorskip("torch")
    with pytest.raises(AssertionError, match="^exited on their own: {'executor': -9}\n") as e:
        with Stack([executor(write_tiny_llama(tmp_path / "llama"))], tmp_path, fork=fork) as stack:
            os.kill(stack.procs["executor"].pid, signal.SIGKILL)
            stack.procs["executor"].wait()
            with pytest.raises(AssertionError, match="executor exited with code -9 while waiting for Godot"):
                stack.wait_until(lambda: False, "Godot")
    assert f"lines of {tmp_path / 'executor.log'}" in str(e.value)


@modes
def test_a_wrong_flag_fails_the_start_at_once_with_the_log_and_leaves_nothing(tmp_path, fork):
    with pytest.raises(AssertionError, match="executor exited with code") as e:
        Stack([Service("executor", flags={"--no-such-flag": 1})], tmp_path, fork=fork)
    assert "no-such-flag" in str(e.value)


def test_the_fork_server_outlives_a_sigterm_to_its_group_and_its_members_still_stop_on_one(tmp_path):
    """SIGTERM to a supervisor's whole group (timeout(1), systemd) reaches the fork server, which shares that
    group: were it to die, every member would get its parent-death SIGTERM at once, before the supervisor could
    stop them in order. A member itself still stops on SIGTERM."""
    pytest.importorskip("torch")
    with Stack([executor(write_tiny_llama(tmp_path / "llama"))], tmp_path, fork=True) as stack:
        member = stack.procs["executor"].pid
        server = int(Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(server, signal.SIGTERM)
        time.sleep(1.0)
        assert alive(server) and alive(member) and stack.procs["executor"].poll() is None
        stack.terminate("executor")
        assert stack.wait("executor") == 0
    # A SIGTERM that reaches a member before its own code runs stops it too (blocked in the server, not lost).
    for _ in range(3):
        with Stack([Service("scheduler")], tmp_path / "early", wait=False, fork=True) as stack:
            stack.terminate("scheduler")
            assert stack.wait("scheduler", seconds=10) in (0, -signal.SIGTERM)     # stopped, not hung


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@modes
def test_teardown_leaves_no_process_of_the_group_and_a_killed_parent_takes_its_stack_along(tmp_path, fork):
    pytest.importorskip("torch")
    model = write_tiny_llama(tmp_path / "llama")
    with Stack([executor(model, "a"), executor(model, "b")], tmp_path, fork=fork) as stack:
        # One group for all (new processes), or one for each (forked): the stop signals each of them.
        groups = {stack.group.pgid} - {None} | stack.group.forked
        assert len(groups) == (2 if fork else 1)
        assert sorted(m for g in groups for m in group_members(g)) == sorted(p.pid for p in stack.procs.values())
    assert [m for g in groups for m in group_members(g)] == []
    # A parent killed with SIGKILL (a pytest stopped hard) runs no teardown: its stack goes all the same.
    flags = {k: str(v) for k, v in executor(model).flags.items()}
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from launcher.processes import Service, Stack
        stack = Stack([Service("executor", flags={flags!r})], {str(tmp_path / "orphan")!r}, fork={fork!r})
        print(stack.procs["executor"].pid, flush=True)
        time.sleep(600)
        """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert alive(child)
    parent.kill()
    parent.wait()
    wait_until(lambda: not alive(child), 30, "the orphaned executor to stop")


def test_an_idle_executor_on_sigterm_leaves_without_waiting_out_its_drain_while_its_scheduler_stays(launch, tmp_path):
    """The scheduler hears of a drain in a step's reply, and an idle link sends no step: an executor that holds
    no request must not sit out its whole drain period (here far longer than the wait below) for a stream
    nobody will close."""
    pytest.importorskip("torch")
    model = write_tiny_llama(tmp_path / "llama")
    ex = executor(model)
    ex.flags["--drain-seconds"] = 3600
    stack = launch(ex, Service("scheduler", flags={"--metrics-address": "", "--retry-seconds": 0.2}))
    stack.terminate("executor")
    assert stack.wait("executor", seconds=120) == 0
    assert "drained: no request here" in stack.log("executor").read_text()
    assert stack.alive("scheduler")


def test_free_ports_come_from_below_the_kernels_ephemeral_range_in_whole_free_runs():
    import socket
    from pathlib import Path

    from launcher.processes import free_port_runs

    firsts = free_port_runs(5, 3)
    assert len(set(firsts)) == 5
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ephemeral.is_file():
        low = int(ephemeral.read_text().split()[0])
        assert all(10_000 <= p and p + 2 < low for p in firsts)
    for p in firsts:           # each run is free right after it was handed out
        for port in range(p, p + 3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
