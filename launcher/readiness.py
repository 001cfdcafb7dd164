"""Whether a starting member serves yet: a gateway's /health answers 200, another service's gRPC health says
SERVING (over mTLS with the member's own certificate where it has one)."""

from __future__ import annotations

from pathlib import Path


def channel_to(s):
    """A channel to a member, over mTLS with its own certificate when it has a --tls-dir (health answers any
    certificate from the CA)."""
    import grpc

    # gRPC's default reconnect backoff (1 s and up) would see a starting member serve a second late.
    fast = [(f"grpc.{k}_reconnect_backoff_ms", ms) for k, ms in (("initial", 50), ("min", 50), ("max", 200))]
    if not s.flags.get("--tls-dir"):
        return grpc.insecure_channel(s.address, options=fast)
    d = Path(s.flags["--tls-dir"])
    creds = grpc.ssl_channel_credentials(*((d / f).read_bytes() for f in ("ca.crt", "tls.key", "tls.crt")))
    return grpc.secure_channel(s.address, creds, [*fast, ("grpc.ssl_target_name_override", f"stepwire-{s.kind}")])


def serving(s, channel) -> bool:
    """Whether member `s` (a launcher.processes.Service) serves; `channel`: None for a gateway (HTTP)."""
    import grpc
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        if channel is None:
            return httpx.get(s.url + "/health", timeout=1).status_code == 200
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        return status == health_pb2.HealthCheckResponse.SERVING
    except (httpx.HTTPError, grpc.RpcError):
        return False
