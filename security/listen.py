"""Where a service may listen: with TLS anywhere; without it, on loopback only unless told `--insecure`.

A plaintext internal port lets anyone who reaches it drive the service (write into an executor's KV cache,
submit and read requests at the scheduler), so an operator has to ask for that in so many words.
"""

from __future__ import annotations

import ipaddress

from security.tls import TLSFiles, server_credentials


class InsecureAddress(SystemExit):
    """Raised at start-up: the process exits with this message."""


def host_of(address: str) -> str:
    """The host part of `host:port`, `[v6]:port` or a bare host; '' for a wildcard like `:50051`."""
    if address.startswith("["):
        return address[1:address.index("]")]
    if address.count(":") > 1:          # a bare IPv6 address
        return address
    return address.rsplit(":", 1)[0] if ":" in address else address


def is_loopback(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False        # a wildcard, a name that could resolve to anything, or nothing at all


def require_loopback(address: str, insecure: bool, what: str) -> None:
    if not insecure and not is_loopback(address):
        raise InsecureAddress(
            f"refusing to serve {what} in plaintext on {address}: configure TLS (--tls-dir, or --tls-cert, "
            f"--tls-key and --tls-ca) or listen on loopback; --insecure allows it anyway")


def add_port(server, address: str, files: TLSFiles | None, insecure: bool, what: str) -> int:
    """Bind `server` to `address`: mTLS with `files`, else plaintext within the loopback rule."""
    if files is not None:
        return server.add_secure_port(address, server_credentials(files))
    require_loopback(address, insecure, what)
    return server.add_insecure_port(address)


def describe(files: TLSFiles | None) -> str:
    return "mTLS" if files is not None else "plaintext"

