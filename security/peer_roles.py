"""Each RPC admits only the roles that need it: a table of method -> roles, checked against the role the caller's
certificate names (identity.py) before the method runs or reads a message.

The handshake already proved the certificate comes from our CA; this decides what its holder may do, so a
compromised pod of one service cannot drive another service's peers. A method missing from the table admits
nobody. Health and reflection stay open to every peer the handshake let in (probes, grpcurl). A refusal is
PERMISSION_DENIED and a log line naming the role and the method; the same pair is logged once a window and
counted meanwhile, so a misconfigured or hostile peer cannot flood the log. Without TLS there is no
certificate to read and no check (plaintext stays on loopback: listen.py).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping

import grpc
from cryptography import x509
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from pydantic import Field

from security.identity import DEFAULT_TRUST_DOMAIN, TRUST_DOMAIN_PATTERN, role_of, roles_named, spiffe_id
from security.tls import TLSFiles, TLSSettings

log = logging.getLogger("stepwire.security")
OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME})
LOG_WINDOW_SECONDS = 30.0


class RoleSettings(TLSSettings):
    """A server's TLS flags and the trust domain of the roles it admits."""

    trust_domain: str = Field(DEFAULT_TRUST_DOMAIN, pattern=TRUST_DOMAIN_PATTERN, description="with TLS: the "
                              "SPIFFE trust domain of the roles certificates name (URI spiffe://<domain>/<role>); "
                              "each RPC admits only the roles that need it")


class WrongOwnRole(SystemExit):
    """Raised at start-up: the process exits with this message."""


def require_own_role(files: TLSFiles, trust_domain: str, role: str) -> None:
    """A service started with another role's certificate would be refused by every peer, or admit the wrong
    one; say so at start rather than in its peers' logs."""
    named = roles_named(x509.load_pem_x509_certificate(files.cert.read_bytes()), trust_domain)
    if named != [role]:
        raise WrongOwnRole(f"the certificate in {files.cert} must name this service's role with the URI "
                           f"{spiffe_id(trust_domain, role)}; in trust domain {trust_domain} it names "
                           f"{', '.join(named) or 'none'} (issue it with `stepwire certs` or the Helm chart; "
                           f"--trust-domain must match)")


def interceptors(files: TLSFiles | None, trust_domain: str, role: str,
                 allowed: Mapping[str, frozenset[str]]) -> list[grpc.aio.ServerInterceptor]:
    """The role check for a server with TLS, after checking its own certificate; none in plaintext."""
    if files is None:
        return []
    require_own_role(files, trust_domain, role)
    return [PeerRoles(allowed, trust_domain)]


class PeerRoles(grpc.aio.ServerInterceptor):
    def __init__(self, allowed: Mapping[str, frozenset[str]], trust_domain: str,
                 open_services: frozenset[str] = OPEN_SERVICES):
        self.allowed = allowed
        self.trust_domain = trust_domain
        self.open_services = open_services
        self.throttle = Throttle(LOG_WINDOW_SECONDS)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.lstrip("/").rsplit("/", 1)[0] in self.open_services:
            return handler
        allowed = self.allowed.get(method, frozenset())

        async def check(context) -> None:
            pems = context.auth_context().get("x509_pem_cert")
            role = role_of(pems[0], self.trust_domain) if pems else None
            if role in allowed:
                return
            who = f"role {role}" if role else f"no single role in trust domain {self.trust_domain}"
            repeats = self.throttle.due((role, method))
            if repeats is not None:
                log.warning("refused %s to a peer at %s whose certificate names %s; it admits %s%s", method,
                            context.peer(), who, ", ".join(sorted(allowed)) or "nobody",
                            f" ({repeats} more such refusals since the last line)" if repeats else "")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method} does not admit {who}")

        return checked(handler, check)


def checked(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """`handler` with `await check(context)` first, whatever its kind (grpc picks how to call by the kind)."""
    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    inner = getattr(handler, kind)
    if inspect.isasyncgenfunction(inner):
        async def method(request_or_iterator, context):
            await check(context)
            async for reply in inner(request_or_iterator, context):
                yield reply
    else:
        async def method(request_or_iterator, context):
            await check(context)
            return await inner(request_or_iterator, context)
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(method, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class Throttle:
    """Once per window per key: `due(key)` is the number of calls it swallowed since it last said yes, or None."""

    def __init__(self, window: float, clock=time.monotonic, max_keys: int = 1024):
        self.window, self.clock, self.max_keys = window, clock, max_keys
        self.seen: dict[object, tuple[float, int]] = {}

    def due(self, key) -> int | None:
        now = self.clock()
        last, swallowed = self.seen.get(key, (None, 0))
        if last is not None and now - last < self.window:
            self.seen[key] = (last, swallowed + 1)
            return None
        if len(self.seen) >= self.max_keys:     # keys come from peers' certificates: bound what they can grow
            self.seen.clear()
        self.seen[key] = (now, 0)
        return swallowed
