"""The services as processes on this machine: a service's command line (`command`, which `stepwire serve` uses
too), and `Stack`, which starts a list of services, waits until they serve, hands out their addresses, lets a
test hurt one of them (kill, SIGTERM, SIGSTOP, restart) and stops them all. Every test and benchmark starts its
services here, so a new flag or fault hook is written once, and a fault test runs serve's very command lines.

A Stack's members share one process group and die with the process that started them (tethered.py): a pytest
killed mid-run leaves no executor behind. The parent-death signal follows the thread that started a member,
so start members from the thread that outlives the stack (pytest's, a benchmark's main thread).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher.forked import Forked
from launcher.readiness import channel_to, serving
from launcher.tethered import ProcessGroup

ROOT = Path(__file__).resolve().parent.parent
# The one place that puts a service's module on a command line (test_import_graph.py holds tests and benches to it).
MODULE = {"executor": "executor_service.server", "scheduler": "scheduler_service.server", "gateway": "gateway.server"}
# What each kind listens on: a Stack gives each of these flags a free loopback port unless the caller set it
# (to an address of its choice, or to "" where the service allows none, e.g. --metrics-address "").
LISTENS = {"executor": ("--address", "--metrics-address"), "scheduler": ("--address", "--metrics-address"),
           "gateway": ("--port", "--grpc-address")}
STOP_SECONDS = 15.0    # for the members to stop on SIGTERM before they are killed
READY_SECONDS = 120.0  # for a member to serve; a member that exits meanwhile fails the wait at once
FORK = False           # Stack's default: fork members from a server that imported them (forked.py), or start each anew


def flag_dict(words) -> dict:
    """Command-line words as {flag: value}: a value is the word after a flag that is not a flag itself, and a
    flag with none is True (["--a", "1", "--b", "--c", ""] -> {"--a": "1", "--b": True, "--c": ""})."""
    if isinstance(words, dict):
        return dict(words)
    words, out = [str(w) for w in words], {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            value = words[i + 1] if i + 1 < len(words) else None
            out[w] = True if value is None or value.startswith("--") else value
        elif i == 0 or not words[i - 1].startswith("--"):
            raise ValueError(f"{w!r} follows no flag in {words}")
    return out


def _dialable(address: str) -> str:
    """The address a client on this machine dials for a server listening on `address`."""
    host, port = str(address).rsplit(":", 1)
    return f"127.0.0.1:{port}" if host in ("", "0.0.0.0", "[::]") else f"{host}:{port}"


@dataclass
class Service:
    """One service process: its kind, its name in the stack, its flags and the environment it adds."""
    kind: str                                    # "executor", "scheduler" or "gateway"
    name: str = ""                               # unique in its stack (and its log's name); default: the kind
    flags: dict = field(default_factory=dict)    # flag -> value (True: bare; None, False: left out), or words
    env: dict = field(default_factory=dict)      # over the parent's environment; None removes a variable
    autostart: bool = True                       # False: the stack starts it when asked (Stack.start)

    def __post_init__(self):
        if self.kind not in MODULE:
            raise ValueError(f"unknown service kind {self.kind!r}; one of {sorted(MODULE)}")
        self.name = self.name or self.kind
        self.flags = flag_dict(self.flags)

    @property
    def address(self) -> str:
        """The gRPC address it serves (a gateway's public stepwire.v1 API), as a client here dials it."""
        return _dialable(self.flags["--grpc-address" if self.kind == "gateway" else "--address"])

    @property
    def url(self) -> str:
        """A gateway's HTTP root."""
        return f"http://127.0.0.1:{self.flags['--port']}"


def command(service: Service) -> list[str]:
    """This Python running the service's module with its flags."""
    return [sys.executable, "-m", MODULE[service.kind], *arguments(service)]


def arguments(service: Service) -> list[str]:
    """The service's flags as the words of its command line."""
    words = []
    for flag, value in service.flags.items():
        if value is True:
            words.append(flag)
        elif value is not None and value is not False:
            words += [flag, str(value)]
    return words


def fork(service: Service, group: ProcessGroup, *, env: dict, log: str | None, cwd: str) -> Forked:
    """The service forked from the fork server (forked.py) as `command` would start it, its group in `group`.
    One place for the server's preload list: the first member to start the server fixes it."""
    proc = Forked(MODULE[service.kind], arguments(service), env=env, log=log, cwd=cwd, preload=MODULE.values())
    group.join(proc.pid)
    return proc


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports: all are held while they are picked, so none is handed out twice."""
    return free_port_runs(n, 1)


def free_port_runs(count: int, length: int) -> list[int]:
    """The first ports of `count` runs of `length` consecutive free loopback ports (`stepwire serve --executors N`
    gives executor i the port and metrics port base + i), all held while they are picked. They are picked below
    the kernel's ephemeral range where it has one: a port bound to 0 and released is the kernel's to give to
    any process's next outgoing connection before the service binds it (that cost one CI run 17 tests), a port
    below the range only to another drawer, and each drawing process has a slice of its own (_below_ephemeral)."""
    quiet = _below_ephemeral(length)
    draw = random.SystemRandom()
    with contextlib.ExitStack() as held:
        firsts: list[int] = []
        for _ in range(10_000):
            if len(firsts) == count:
                return firsts
            first = held.enter_context(socket.socket())
            try:
                first.bind(("127.0.0.1", draw.randrange(*quiet) if quiet else 0))
                base = first.getsockname()[1]
                for i in range(1, length):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", base + i))
            except OSError:
                continue     # taken: what was bound stays held until the end, and another base is tried
            firsts.append(base)
    raise OSError(f"no {count} runs of {length} free loopback ports")


def _below_ephemeral(length: int) -> tuple[int, int] | None:
    """This process's share of the ports from 10000 up to the kernel's ephemeral range (Linux): one of 8 slices,
    by its pytest-xdist worker number where it has one, else by its pid, so that processes drawing at once (the
    test workers) draw from different ports: a port drawn and released is free only until its service binds
    it, seconds later, and another drawer must not pick it in between. None where no such range exists."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if low - 10_000 < 8 * 1000:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    share = (low - 10_000) // 8
    start = 10_000 + (int(worker) if worker.isdigit() else os.getpid()) % 8 * share
    return start, start + share - length


def place(services: list[Service]) -> None:
    """Fill in what the caller left out: a free loopback port for each address a service listens on; a
    scheduler with neither --executors nor --discovery drives every executor of the list; a gateway with no
    --scheduler uses the list's scheduler."""
    missing = [(s, f) for s in services for f in LISTENS[s.kind] if f not in s.flags]
    for (s, f), port in zip(missing, free_ports(len(missing)), strict=True):
        s.flags[f] = port if f == "--port" else f"127.0.0.1:{port}"
    executors = ",".join(s.address for s in services if s.kind == "executor")
    scheduler = next((s for s in services if s.kind == "scheduler"), None)
    for s in services:
        if s.kind == "scheduler" and executors and not {"--executors", "--discovery"} & s.flags.keys():
            s.flags["--executors"] = executors
        if s.kind == "gateway" and scheduler is not None:
            s.flags.setdefault("--scheduler", scheduler.address)


class Stack:
    """Services started in the given order (logging to `<workdir>/<name>.log`), with `wait` each waited for
    until it serves. `stack[name]` is a member's Service (addresses filled in), `stack.procs[name]` its process.
    Leaving the `with` block stops all; it fails if a member died unasked (kill, terminate, restart, wait ask)."""

    def __init__(self, services: list[Service], workdir: str | Path, *, wait: bool = True,
                 seconds: float = READY_SECONDS, fork: bool | None = None):
        self.services = {s.name: s for s in services}
        if len(self.services) != len(services):
            raise ValueError(f"two services share a name: {[s.name for s in services]}")
        self.workdir, self.seconds, self.fork = Path(workdir), seconds, FORK if fork is None else fork
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen | Forked] = {}
        self.up: set[str] = set()       # started and not stopped on purpose: an exit of one of these is a fault
        self.group = ProcessGroup()
        place(services)
        try:
            for s in services:
                if s.autostart:
                    self.start(s.name)
            if wait:
                for name in list(self.procs):
                    self.wait_ready(name)
        except BaseException:
            self.close(check=False)
            raise

    def __getitem__(self, name: str) -> Service:
        return self.services[name]

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(check=exc_type is None)

    def start(self, name: str) -> subprocess.Popen:
        """Start a member that is not running (one never started, or one that was stopped)."""
        if self.alive(name):
            raise RuntimeError(f"{name} is already running")
        s = self.services[name]
        env = {**os.environ, **s.env}
        env = {k: v for k, v in env.items() if v is not None}
        with open(self.log(name), "a") as log:     # append: a restarted member goes on with its log
            log.write(f"=== launcher {time.strftime('%H:%M:%S')}: start {name}\n")
            log.flush()
            if self.fork:
                self.procs[name] = fork(s, self.group, env=env, log=str(self.log(name)), cwd=str(ROOT))
            else:
                self.procs[name] = self.group.popen(command(s), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                    env=env)
        self.up.add(name)
        return self.procs[name]

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def kill(self, name: str) -> int:
        """SIGKILL; returns once it is gone, with its exit code."""
        self.up.discard(name)
        self.procs[name].kill()
        return self.procs[name].wait()

    def terminate(self, name: str) -> None:
        """SIGTERM, without waiting: the member may take its time (an executor drains first); see wait."""
        self.up.discard(name)
        self.procs[name].terminate()

    def wait(self, name: str, seconds: float | None = STOP_SECONDS) -> int:
        """Wait for a member the caller expects to exit, and return its exit code."""
        self.up.discard(name)
        return self.procs[name].wait(timeout=seconds)

    def pause(self, name: str) -> None:
        """SIGSTOP: it holds its connections open and answers nothing, as a frozen host would."""
        self.procs[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGCONT)

    def restart(self, name: str, signum: int = signal.SIGTERM, pause: float = 0.0,
                seconds: float = 30.0) -> subprocess.Popen:
        """Stop it with `signum` if it runs, wait for its exit, wait `pause` seconds, and start it again: the
        same command on the same addresses."""
        if self.alive(name):
            self.up.discard(name)
            self.procs[name].send_signal(signum)
            self.procs[name].wait(timeout=seconds)
        time.sleep(pause)
        return self.start(name)

    def wait_until(self, predicate, what, seconds: float | None = None, interval: float = 0.2):
        """Poll `predicate` until it returns something truthy, and return that. Fails, with the members' log
        tails, when `seconds` (the stack's own by default) pass, or at once when a member dies on its own.
        `what` (a string, or a callable giving one) says what was awaited."""
        deadline = time.monotonic() + (self.seconds if seconds is None else seconds)
        while True:
            value = predicate()
            if value:
                return value
            dead = self.exited()
            if dead or time.monotonic() >= deadline:
                why = ", ".join(f"{n} exited with code {c}" for n, c in dead.items()) or "timed out"
                raise AssertionError(f"{why} while waiting for {what() if callable(what) else what}\n"
                                     + self.tails())
            time.sleep(interval)

    def wait_ready(self, name: str, seconds: float | None = None) -> None:
        """Until it serves: a gateway's /health answers 200, another service's gRPC health says SERVING."""
        s = self.services[name]
        with contextlib.nullcontext() if s.kind == "gateway" else channel_to(s) as channel:
            self.wait_until(lambda: serving(s, channel), f"{name} to serve (/health 200, or gRPC health SERVING)",
                            seconds, interval=0.3 if channel is None else 0.2)

    def exited(self) -> dict[str, int]:
        """The members that exited though nobody stopped them: name -> exit code."""
        return {n: self.procs[n].returncode for n in sorted(self.up) if self.procs[n].poll() is not None}

    def check_alive(self) -> None:
        if dead := self.exited():
            raise AssertionError(f"exited on their own: {dead}\n" + self.tails())

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def logs(self) -> list[Path]:
        return [self.log(n) for n in self.services if self.log(n).exists()]

    def tails(self, lines: int = 40) -> str:
        """The end of each member's log, for failure messages."""
        return "\n".join(line for p in self.logs() for line in
                         [f"--- the last lines of {p}:", *p.read_text(errors="replace").splitlines()[-lines:]])

    def close(self, check: bool = True, seconds: float = STOP_SECONDS) -> None:
        """SIGTERM to every member at once (a service stops only after its grace period while a peer still holds
        a stream to it: one after another would cost a grace period each), up to `seconds`, then SIGKILL to the
        whole group: members that did not stop, and whatever they started. With `check`, fails afterwards if a
        member had died on its own or needed the SIGKILL."""
        dead = self.exited()
        running = [n for n, p in self.procs.items() if p.poll() is None]
        for n in running:
            self.procs[n].terminate()
            self.procs[n].send_signal(signal.SIGCONT)     # a paused member would hold its SIGTERM for ever
        deadline, stragglers = time.monotonic() + seconds, []
        for n in running:
            try:
                self.procs[n].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stragglers.append(n)
        self.group.signal(signal.SIGKILL)
        for p in self.procs.values():
            p.wait()
        self.up.clear()
        why = ([f"exited on their own: {dead}"] if dead else []) + \
            ([f"still ran {seconds:g}s after SIGTERM: {stragglers}"] if stragglers else [])
        if check and why:
            raise AssertionError("; ".join(why) + "\n" + self.tails())

