"""Child processes that cannot outlive the process that started them.

`stepwire serve` starts every service this way. Two mechanisms, because each covers what the other cannot:

- **The parent-death signal** (Linux `prctl(PR_SET_PDEATHSIG)`): the kernel sends each child SIGTERM when
  serve dies, however it dies, kill -9 included, when no code of serve's can run any more. SIGTERM rather
  than SIGKILL, so that each service still stops cleanly (an executor leaves its group, a gateway closes
  its streams).
- **One process group for all of them**, apart from serve's own: one signal reaches every service and all
  they started (an executor's rank processes), so a stop can sweep up whatever is left; and the terminal's
  Ctrl-C reaches serve alone, which stops the services in order instead of every process at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
# Looked up once, here: between fork and exec in a process with threads (a test's gRPC channels), the child may
# only call what takes no lock another thread could have held at the fork, and loading a library takes one.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with(parent: int) -> None:
    """Runs in the child between fork and exec."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:   # the parent died before the signal was armed: nobody would send it now
        os.kill(os.getpid(), signal.SIGTERM)


class ProcessGroup:
    """The group every child joins: made by the first child, and again if all its members have exited."""

    def __init__(self):
        self.pgid: int | None = None

    def popen(self, command: list[str], **kw) -> subprocess.Popen:
        parent = os.getpid()
        if self.pgid is not None and not self.alive():
            self.pgid = None
        try:
            proc = subprocess.Popen(command, process_group=self.pgid or 0, preexec_fn=lambda: _die_with(parent),
                                    **kw)
        except (OSError, subprocess.SubprocessError):
            if self.pgid is None:
                raise
            # Its last member exited between the check and the fork: start a new group.
            self.pgid = None
            proc = subprocess.Popen(command, process_group=0, preexec_fn=lambda: _die_with(parent), **kw)
        if self.pgid is None:
            self.pgid = proc.pid
        return proc

    def alive(self) -> bool:
        return self.pgid is not None and self.signal(0)

    def signal(self, signum: int) -> bool:
        """Send `signum` to every process of the group; False when none is left."""
        if self.pgid is None:
            return False
        try:
            os.killpg(self.pgid, signum)
            return True
        except ProcessLookupError:
            return False
