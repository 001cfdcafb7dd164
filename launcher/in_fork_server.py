"""Imported by the fork server alone (forked.py puts it first in the server's preload list), never elsewhere.

The server shares its starter's process group, so SIGTERM sent to that whole group (timeout(1), systemd's
control-group kill, `kill -TERM -PGID`) would kill it, and with it every member (their parent-death signal),
before the starter could stop them in its order with each draining first. So the server ignores SIGTERM; it
still ends when its starter does (its alive pipe closes). Members take the default back at once
(forked._main)."""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
