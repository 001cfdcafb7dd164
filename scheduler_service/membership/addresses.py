"""Executor addresses as `host:port` strings, an IPv6 host in brackets: what every membership source hands
the fleet. A module of its own so the sources (membership/discovery.py, endpoint_slices.py) share it without importing
each other."""

from __future__ import annotations


def host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
