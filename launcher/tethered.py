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

import os
import subprocess
import sys

# The parent-death signal is armed by the child itself, in a few lines of Python that then exec the command (the
# pid stays, so does the signal), rather than in a preexec_fn: with one, subprocess forks instead of vforking,
# which runs the parent's at-fork handlers in the child, and gRPC's (a test's or a benchmark's channels) restart
# a poller there that aborts the child once subprocess closes its descriptors.
_ARM = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"   # 1: PR_SET_PDEATHSIG
        # The parent died before the signal was armed: nobody would send it now.
        "if os.getppid() != int(sys.argv[1]): os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.execvp(sys.argv[2], sys.argv[2:])")


def _tethered(command: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-c", _ARM, str(os.getpid()), *command]


class ProcessGroup:
    """The group every child joins: made by the first child, and again if all its members have exited."""

    def __init__(self):
        self.pgid: int | None = None
        self.forked: set[int] = set()       # forked members' groups, one each (forked.py)

    def popen(self, command: list[str], **kw) -> subprocess.Popen:
        if self.pgid is not None and not self.alive():
            self.pgid = None
        try:
            proc = subprocess.Popen(_tethered(command), process_group=self.pgid or 0, **kw)
        except (OSError, subprocess.SubprocessError):
            if self.pgid is None:
                raise
            # Its last member exited between the check and the fork: start a new group.
            self.pgid = None
            proc = subprocess.Popen(_tethered(command), process_group=0, **kw)
        if self.pgid is None:
            self.pgid = proc.pid
        return proc

    def join(self, pgid: int) -> None:
        """A member forked elsewhere (forked.py), which made a group of its own: `signal` reaches it too."""
        self.forked.add(pgid)

    def leave(self, pgid: int) -> None:
        """Forget an exited member's group once nobody is left in it, so that restarts do not pile up ids the
        system may hand out again. (Not at join: a member just forked may not have made its group yet.)"""
        if not _killpg(pgid, 0):
            self.forked.discard(pgid)

    def alive(self) -> bool:
        return self.pgid is not None and _killpg(self.pgid, 0)

    def signal(self, signum: int) -> bool:
        """Send `signum` to every process of the group; False when none is left."""
        sent = self.pgid is not None and _killpg(self.pgid, signum)
        for pgid in list(self.forked):
            if _killpg(pgid, signum):
                sent = True
            else:
                self.forked.discard(pgid)
        return sent


def _killpg(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False
