"""Service processes forked from a server that imported the services once.

A service started as a new Python (`command`) spends most of its start importing: an executor about a second of
CPU on torch alone, of the two it takes to serve. So `stepwire serve` (where no GPU is: local_stack.forks) and
the test suite's stacks (`Stack(fork=True)`, which tests/conftest.py turns on; it starts about 170 services on
2 cores) fork each one from multiprocessing's fork server instead, which imported every service's module when
it started, and call the same `main` with the same flags that `command` puts on a command line. Benchmarks keep
starting new processes.

What a caller sees is what a process started by `command` gives it: a pid to signal (SIGKILL, SIGSTOP), an exit
code (negative for a signal), a log of stdout and stderr, a group of its own that a stop sweeps up, and SIGTERM
when the process that started it dies. Fork safety: the server imports and does nothing else (no thread of
gRPC's or a pool of torch's is running when it forks), and each member sets up its own state after the fork.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import threading

import setproctitle

_context = None
_running: set = set()          # every member started here that may still run


@atexit.register
def _kill_the_left_behind() -> None:
    """Members a stop never reached (a test torn down hard) die with their group now. Registered after
    multiprocessing's own exit function, so it runs first: that one would SIGTERM each daemon member and
    wait for it without a limit, for ever on a paused member or one draining for minutes."""
    for member in list(_running):
        if member.poll() is None:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError):
                    kill(member.pid, signal.SIGKILL)


def _fork_server(preload):
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["launcher.in_fork_server", *preload])
    return _context


def stop_server() -> None:
    """Stop the fork server and the resource tracker it started, once the members are gone: a supervisor that
    exits leaves no process behind (both would see their starter's end and exit too, but only after it)."""
    if _context is not None:
        multiprocessing.forkserver._forkserver._stop()
        multiprocessing.resource_tracker._resource_tracker._stop()


def _main(module: str, argv: list[str], env: dict, log: str | None, cwd: str) -> None:
    """In the forked member: the group, the parent-death signal, the log and the environment a new process
    would have had, then the service's main."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})    # the server blocks it (in_fork_server.py)
    os.setpgid(0, 0)
    server_pid = os.getppid()     # alive still: we hold its pipe until the next lines close it
    # multiprocessing hands each member the end of the pipe that keeps the fork server alive (so that a member
    # could fork members of its own); held, the server would outlive the tests' process, and so would we.
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)      # 1: PR_SET_PDEATHSIG: the fork server's death
        if os.getppid() != server_pid:           # it died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)
    if log is not None:              # else the server's own output, which is its starter's
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")   # as an interpreter's
    # ps and /proc show the command that would have started it, not the fork server's. (Before the environment
    # changes: setproctitle finds room for a long title where the process's environment starts.)
    setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *argv]))
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv]
    try:
        importlib.import_module(module).main(argv)
    finally:
        # multiprocessing ends a member with os._exit, which runs no atexit function: run them as an interpreter
        # would, once its other non-daemon threads ended.
        threading._shutdown()
        atexit._run_exitfuncs()


class Forked:
    """A forked member, with the part of subprocess.Popen's interface the launcher and the tests use.
    `preload`: the modules the fork server imports; read when this process's first member starts the server,
    and not after (launcher/processes.py always passes every service's module)."""

    def __init__(self, module: str, argv: list[str], *, env: dict, log: str | None, cwd: str, preload):
        self.args = [module, *argv]
        self._proc = _fork_server(preload).Process(target=_main, args=(module, argv, env, log, cwd), daemon=True)
        self._proc.start()
        self.pid = self._proc.pid
        _running.difference_update([m for m in _running if m.poll() is not None])
        _running.add(self)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def send_signal(self, signum: int) -> None:
        if self._proc.exitcode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
