"""A minimal OTLP/gRPC trace receiver: the standard TraceService, keeping what it gets in memory.

Tests and benchmarks point the services' OTEL_EXPORTER_OTLP_ENDPOINT at it. It is not a collector:
use the OpenTelemetry Collector, Tempo or Jaeger in a real deployment.

    python -m tools.otlp_receiver --address 127.0.0.1:4317 --out spans.jsonl
"""

from __future__ import annotations

import argparse
import json
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict]:
    """One plain dict per span, with the service name of the process that sent it."""
    spans = []
    for rs in request.resource_spans:
        res = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append({
                    "service": res.get("service.name"), "name": s.name, "kind": s.kind,
                    "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(), "parent_id": s.parent_span_id.hex(),
                    "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                    "attributes": {a.key: _value(a.value) for a in s.attributes},
                    "events": [{"name": e.name, "time_ns": e.time_unix_nano,
                                "attributes": {a.key: _value(a.value) for a in e.attributes}} for e in s.events],
                    "links": [{"trace_id": lk.trace_id.hex(), "span_id": lk.span_id.hex()} for lk in s.links],
                    "status": s.status.code,
                })
    return spans


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out_path: str | None = None):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.out = open(out_path, "a") if out_path else None

    def Export(self, request, context):
        spans = flatten(request)
        with self.lock:
            self.spans += spans
            if self.out:
                self.out.writelines(json.dumps(s) + "\n" for s in spans)
                self.out.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def start(address: str, out_path: str | None = None) -> tuple[grpc.Server, Receiver, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    receiver = Receiver(out_path)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port(address)
    server.start()
    return server, receiver, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="127.0.0.1:4317")
    ap.add_argument("--out", help="append each span as a JSON line to this file")
    a = ap.parse_args()
    server, _, port = start(a.address, a.out)
    print(f"OTLP trace receiver on port {port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
