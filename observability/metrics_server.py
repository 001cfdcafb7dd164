"""The Prometheus /metrics endpoint of the gRPC-only services (the gateway mounts its own on its HTTP app)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("stepwire.metrics")


def serve_metrics(address: str, registry: CollectorRegistry, what: str) -> None:
    """Serve `registry` at http://address/metrics from a daemon thread; an empty address turns it off."""
    if not address:
        return
    host, _, port = address.rpartition(":")
    server, _ = start_http_server(int(port), addr=host or "0.0.0.0", registry=registry)
    log.info("%s metrics on http://%s:%d/metrics", what, host or "0.0.0.0", server.server_port)
