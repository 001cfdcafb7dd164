"""Imported by the fork server alone (forked.py puts it first in the server's preload list), never elsewhere.

The server shares its starter's process group, so SIGTERM sent to that whole group (timeout(1), systemd's
control-group kill, `kill -TERM -PGID`) would kill it, and with it every member (their parent-death signal),
before the starter could stop them in its order with each draining first. So the server blocks SIGTERM; it
still ends when its starter does (its alive pipe closes). Blocked, not ignored: a member inherits the mask,
and a SIGTERM sent to it before it unblocks (forked._main, first thing) waits for it instead of being lost."""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
