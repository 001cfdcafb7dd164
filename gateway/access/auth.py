"""API keys at the gateway's edge: `Authorization: Bearer <key>` on HTTP, `authorization` metadata on gRPC.

Keys come from a file (one per line; blank lines and # comments ignored), re-read when it changes, so a
rotated Kubernetes Secret takes effect without a restart, and from STEPWIRE_API_KEY (comma-separated).
With neither, there is no authentication. Health and metrics stay open: probes and Prometheus carry no key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

import grpc
from fastapi.security.utils import get_authorization_scheme_param
from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, SimpleUser
from starlette.requests import HTTPConnection

from gateway.access.tenants import DEFAULT, Tenant, TenantsError, TenantsFile
from gateway.access.watched_file import WatchedFile
from security.listen import is_loopback

log = logging.getLogger("stepwire.gateway")

ENV = "STEPWIRE_API_KEY"
MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header using "
           "Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
INCORRECT = "Incorrect API key provided."


class AuthSetupError(SystemExit):
    """At start: no usable key where one is needed. The process exits with this message."""


def _digest(key: str) -> bytes:
    # Keys are compared as digests of one length, so the comparison's time says nothing of a key's length.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def parse_keys(text: str) -> list[str]:
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


class ApiKeys:
    def __init__(self, key_file: str = "", env_value: str | None = None, tenants_file: str = ""):
        env_value = os.environ.get(ENV, "") if env_value is None else env_value
        self._env = [_digest(k) for k in parse_keys(env_value.replace(",", "\n"))]
        self._file = None
        if key_file:
            try:
                self._file = WatchedFile(key_file, lambda text: [_digest(k) for k in parse_keys(text)],
                                         "API key file", changed=lambda keys: _keys_changed(key_file, keys))
            except OSError as e:
                raise AuthSetupError(f"stepwire gateway: cannot read --api-key-file {key_file}: {e}") from None
            if not self._file.value:
                raise AuthSetupError(f"stepwire gateway: --api-key-file {key_file} holds no key")
        self.tenants = None
        if tenants_file:
            try:
                self.tenants = TenantsFile(tenants_file, _digest)
            except (OSError, TenantsError) as e:
                raise AuthSetupError(f"stepwire gateway: cannot use --tenants-file {tenants_file}: {e}") from None

    @property
    def enabled(self) -> bool:
        # A key file that later empties refuses everyone rather than opening the gateway.
        return self._file is not None or bool(self._env) or self.tenants is not None

    def check(self, presented: str | None) -> bool:
        return self.identify(presented) is not None

    def identify(self, presented: str | None) -> Tenant | None:
        """The tenant whose key `presented` is (DEFAULT for the API key file's and STEPWIRE_API_KEY's), or None
        when it is no key. Compares with every key, matched or not, in constant time, so neither the timing nor
        the order of the keys tells which one (or how much of one) matched."""
        keys = self._current()
        tenants = self.tenants.current() if self.tenants is not None else []
        if not presented:
            return None
        given = _digest(presented)
        found = None
        for key in keys:
            if hmac.compare_digest(given, key):
                found = DEFAULT
        for key, tenant in tenants:
            if hmac.compare_digest(given, key):
                found = tenant
        return found

    def _current(self) -> list[bytes]:
        return (self._file.current() if self._file is not None else []) + self._env


def _keys_changed(path: str, keys: list[bytes]) -> None:
    log.info("API key file %s changed: %d keys", path, len(keys))
    if not keys:
        log.warning("API key file %s holds no key: every request is refused", path)


def require_key_beyond_loopback(addresses: list[str], keys: ApiKeys, insecure: bool) -> None:
    """At start: an API anyone on the network can reach needs a key, unless the operator says --insecure."""
    exposed = [a for a in addresses if not is_loopback(a)]
    if exposed and not keys.enabled and not insecure:
        raise AuthSetupError(f"stepwire gateway: refusing to serve the API on {', '.join(exposed)} without an API key: "
                           f"set {ENV} or --api-key-file, or listen on loopback; --insecure allows it anyway")


def bearer(value: str | None) -> str | None:
    scheme, token = get_authorization_scheme_param(value)
    return token if scheme.lower() == "bearer" and token else None


class KeyRefused(AuthenticationError):
    """HTTP: the 401 to answer. `code` as OpenAI sets it: null for a missing key, invalid_api_key for a wrong one."""

    def __init__(self, message: str, code: str | None):
        super().__init__(message)
        self.code = code


class TenantUser(SimpleUser):
    """The caller, as the handlers find it in `request.user`: its API key's tenant."""

    def __init__(self, tenant: Tenant):
        super().__init__(tenant.name or "api-key")
        self.tenant = tenant


def tenant_of(request) -> Tenant:
    """The HTTP caller's tenant: DEFAULT where no key is asked for."""
    user = request.scope.get("user")
    return user.tenant if isinstance(user, TenantUser) else DEFAULT


def grpc_tenant(keys: ApiKeys | None, context) -> Tenant:
    """The gRPC caller's tenant, from the key GrpcKeys already let through: DEFAULT where no key is asked for."""
    if keys is None or not keys.enabled:
        return DEFAULT
    key = bearer(dict(context.invocation_metadata() or ()).get("authorization"))
    return keys.identify(key) or DEFAULT


class HttpKeys(AuthenticationBackend):
    """For Starlette's AuthenticationMiddleware, which runs before the body is read: a caller without a
    key is turned away without costing a parse."""

    def __init__(self, keys: ApiKeys, open_paths: frozenset[str]):
        self.keys = keys
        self.open_paths = open_paths

    async def authenticate(self, conn: HTTPConnection):
        if conn.url.path in self.open_paths:
            return None
        # Anthropic's clients send their key as x-api-key (/v1/messages); any route takes either.
        key = bearer(conn.headers.get("authorization")) or conn.headers.get("x-api-key") or None
        if key is None:
            raise KeyRefused(MISSING, None)
        tenant = self.keys.identify(key)
        if tenant is None:
            raise KeyRefused(INCORRECT, "invalid_api_key")
        return AuthCredentials(["api"]), TenantUser(tenant)


class GrpcKeys(grpc.aio.ServerInterceptor):
    """Every method but the open ones (the health service) needs `authorization: Bearer <key>` metadata."""

    def __init__(self, keys: ApiKeys, open_services: frozenset[str]):
        self.keys = keys
        self.open_services = open_services

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        service = details.method.lstrip("/").rsplit("/", 1)[0]
        if service in self.open_services:
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        key = bearer(metadata.get("authorization"))
        if key is not None and self.keys.check(key):
            return await continuation(details)
        return _refusal(await continuation(details), INCORRECT if key is not None else
                        "missing API key: send the metadata authorization: Bearer <key>")


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the method's own kind that only refuses (grpc picks how to read the call by the kind)."""

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    streaming = (handler.request_streaming, handler.response_streaming) if handler is not None else (False, False)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[streaming](refuse)
