"""Stand-ins for what the scheduler discovers executors through, run by the tests on loopback:

- `FakeKubeAPI`: the two EndpointSlice calls of a Kubernetes API server (list, and watch from a
  resourceVersion), with a history that can be compacted so that old watches get 410 Gone. Given RBAC
  rules (a Role's), it authorizes every request as the API server would for a namespaced Role: anything
  they do not allow is 403 Forbidden, and recorded in `denied`;
- `FakeDNS`: a UDP name server answering A queries for names the test sets.

Both speak the real protocols, so the scheduler drives them with the real `kubernetes` client and the real
resolver.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


def endpoint_slice(name: str, service: str, port: int, endpoints: list[dict], version: int,
                   namespace: str = "ns") -> dict:
    """An EndpointSlice as the API serves it; each endpoint: {"ip", "ready", "serving", "terminating"}."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(version),
                     "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}, {"name": "metrics", "port": 9, "protocol": "TCP"}],
        "endpoints": [{"addresses": [e["ip"]], "conditions": {k: e[k] for k in ("ready", "serving", "terminating")
                                                               if k in e}} for e in endpoints],
    }


def request_attributes(method: str, path: str, query: dict) -> tuple[str, str, str, str] | None:
    """(API group, namespace, resource, verb) of a resource request, as RBAC sees it; None for other paths."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = ""
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    if not rest:
        return None
    named = len(rest) > 1
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "True", "1") else ("get" if named else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if named else "deletecollection"}.get(method, method.lower())
    return group, namespace, rest[0], verb


def allowed_by(rules: list[dict], namespace: str, attrs) -> bool:
    """Whether a Role's rules, bound in `namespace`, allow a request with these attributes."""
    if attrs is None:
        return False
    group, ns, resource, verb = attrs
    if ns != namespace:   # a Role grants nothing outside its namespace, nor on cluster-wide paths
        return False
    return any(group in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r.get("verbs", [])
               for r in rules)


class FakeKubeAPI:
    def __init__(self, namespace: str = "ns", rules: list[dict] | None = None):
        self.namespace = namespace
        self.rules = rules            # a Role's rules to authorize requests by; None: authorize everything
        self.denied: list[tuple] = []  # (method, path, verb) of the requests refused with 403
        # While set, a watch is answered with headers and then nothing, for ever: a connection that died
        # without a word (an API server failover, a NAT's idle timeout) looks like this to the client.
        self.silent = threading.Event()
        self.stopping = threading.Event()
        self.slices: dict[str, dict] = {}
        self.version = 100
        self.history: list[tuple[int, dict]] = []     # (resourceVersion, watch event)
        self.compacted = 0                            # watches from before this get 410 Gone
        self.calls: list[tuple[str, str, str]] = []   # (list|watch, resourceVersion asked for, labelSelector)
        self.watchers: list[queue.Queue] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "u"}}]}))
        return path

    def put(self, name: str, port: int, endpoints: list[dict], service: str = "stepwire-executor") -> None:
        with self.lock:
            self.version += 1
            kind = "MODIFIED" if name in self.slices else "ADDED"
            self.slices[name] = endpoint_slice(name, service, port, endpoints, self.version, self.namespace)
            self._emit(kind, self.slices[name])

    def delete(self, name: str) -> None:
        with self.lock:
            self.version += 1
            s = self.slices.pop(name)
            s["metadata"]["resourceVersion"] = str(self.version)
            self._emit("DELETED", s)

    def expire(self) -> None:
        """Compact the history: open watches end with 410 Gone, and so does any watch from before now."""
        with self.lock:
            self.compacted = self.version
            self.history.clear()
            for w in self.watchers:
                w.put({"type": "ERROR", "object": _gone()})

    def lists(self) -> int:
        return sum(1 for c in self.calls if c[0] == "list")

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        for w in self.watchers:
            w.put(None)

    def _emit(self, kind: str, obj: dict) -> None:
        event = {"type": kind, "object": json.loads(json.dumps(obj))}
        self.history.append((self.version, event))
        for w in self.watchers:
            w.put(event)

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _authorized(self, q) -> bool:
                url = urlparse(self.path)
                attrs = request_attributes(self.command, url.path, q)
                if api.rules is None or allowed_by(api.rules, api.namespace, attrs):
                    return True
                with api.lock:
                    api.denied.append((self.command, url.path, attrs and attrs[3]))
                self._json(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                                 "code": 403, "message": f"{attrs} is not allowed by the Role"})
                return False

            def do_POST(self):
                if self._authorized({}):
                    self._json(405, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 405,
                                     "reason": "MethodNotAllowed", "message": "the fake serves reads only"})

            do_PUT = do_PATCH = do_DELETE = do_POST

            def do_GET(self):
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                if not self._authorized(q):
                    return
                if url.path != f"/apis/discovery.k8s.io/v1/namespaces/{api.namespace}/endpointslices":
                    return self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": url.path})
                selector = q.get("labelSelector", "")
                want = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
                match = lambda s: all(s["metadata"]["labels"].get(k) == v for k, v in want.items())
                if q.get("watch") not in ("true", "True", "1"):
                    with api.lock:
                        api.calls.append(("list", q.get("resourceVersion", ""), selector))
                        items = [s for s in api.slices.values() if match(s)]
                        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                "metadata": {"resourceVersion": str(api.version)}, "items": items}
                    return self._json(200, body)
                since = int(q.get("resourceVersion") or 0)
                events: queue.Queue = queue.Queue()
                with api.lock:
                    api.calls.append(("watch", q.get("resourceVersion", ""), selector))
                    if since < api.compacted:
                        events.put({"type": "ERROR", "object": _gone()})
                    for v, e in api.history:
                        if v > since:
                            events.put(e)
                    api.watchers.append(events)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if api.silent.is_set():
                    api.stopping.wait()
                    with api.lock:
                        api.watchers.remove(events)
                    return
                timeout = float(q.get("timeoutSeconds", 300))
                try:
                    while True:
                        try:
                            e = events.get(timeout=timeout)
                        except queue.Empty:
                            break
                        if e is None:
                            break
                        if e["type"] != "ERROR" and not match(e["object"]):
                            continue
                        self._chunk(json.dumps(e).encode() + b"\n")
                        if e["type"] == "ERROR":
                            break
                    self._chunk(b"")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with api.lock:
                        api.watchers.remove(events)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _json(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def _gone() -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410,
            "message": "too old resource version"}


class FakeDNS:
    """A name server on a loopback UDP port: A records for the names in `records`; others get NXDOMAIN."""

    def __init__(self):
        self.records: dict[str, list[str]] = {}
        self.silent = False           # drop queries (a name server that does not answer)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            if self.silent:
                continue
            q = dns.message.from_wire(data)
            r = dns.message.make_response(q)
            question = q.question[0]
            name = question.name.to_text().rstrip(".")
            if name not in self.records:
                r.set_rcode(dns.rcode.NXDOMAIN)
            elif question.rdtype == dns.rdatatype.A and self.records[name]:
                r.answer.append(dns.rrset.from_text_list(question.name, 1, "IN", "A", self.records[name]))
            self.sock.sendto(r.to_wire(), peer)

    def stop(self) -> None:
        self.sock.close()
