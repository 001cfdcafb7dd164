"""The ports `stepwire serve` is about to listen on, checked before anything starts.

A service whose port is taken exits, and serve starts it again and again ("starting it again in 30s"): right for
a port that a restart finds still held for a moment, wrong for a first start beside another stack, which would
crash-loop until killed. So serve tries each port once, up front, and stops with the port, the flag that moves
it, and the process that holds it where this user may see it.
"""

from __future__ import annotations

import socket


def taken_ports(ports: list[tuple[int, str]]) -> list[str]:
    """One line for each (port, flag) that cannot be bound on loopback now."""
    out = []
    for port, flag in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the services bind: TIME_WAIT is free
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                out.append(f"port {port} is taken ({e.strerror}){holder(port)}: free it, or move it with {flag}")
    return out


def holder(port: int) -> str:
    """", held by pid N (its command line)" for the process listening on `port`, where that can be seen."""
    try:
        import psutil

        for c in psutil.net_connections("tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                cmd = " ".join(psutil.Process(c.pid).cmdline())
                return f", held by pid {c.pid} ({cmd[:160]})"
    except Exception:   # noqa: BLE001 -- who holds it is a hint; another user's processes are not ours to see
        pass
    return ""
