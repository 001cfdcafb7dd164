"""Executors from Kubernetes EndpointSlices: list, then watch from the list's resourceVersion.

The slices are those of the executors' headless Service in one namespace, picked by label selector
(`kubernetes.io/service-name=<service>` by default). An endpoint is an executor while it is `ready` and
not `terminating`. A terminating one (its pod got SIGTERM) leaves the set at once, which makes the fleet
drain it: nothing new goes there, and its running requests finish there while it is still `serving` and
the drain period lasts. A watch that expires (410 Gone) or breaks starts over from a fresh list.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from scheduler_service.membership.addresses import join_host_port
from scheduler_service.settings import SchedulerSettings

log = logging.getLogger("stepwire.scheduler")
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_SLACK_SECONDS = 10   # past the watch's own length, silence means the connection is gone


def api_client(kubeconfig: str) -> client.ApiClient:
    """In-cluster credentials (the pod's service account) unless a kubeconfig is named or none exist."""
    if not kubeconfig:
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except ConfigException:
            pass
    return config.new_client_from_config(config_file=kubeconfig or None)


def namespace(settings: SchedulerSettings) -> str:
    if settings.kubernetes_namespace:
        return settings.kubernetes_namespace
    return NAMESPACE_FILE.read_text().strip() if NAMESPACE_FILE.exists() else "default"


def slice_port(s, port_name: str) -> int | None:
    ports = s.ports or []
    named = [p.port for p in ports if p.name == port_name and p.port]
    if named:
        return named[0]
    return ports[0].port if len(ports) == 1 and ports[0].port else None


def executors_of(s, port_name: str) -> set[str]:
    """The addresses of a slice's endpoints that may take new requests."""
    port = slice_port(s, port_name)
    if port is None:
        return set()
    found = set()
    for ep in s.endpoints or []:
        cond = ep.conditions
        # Unset conditions mean "unknown", which the API says to read as ready and not terminating.
        ready = cond is None or cond.ready is not False
        terminating = cond is not None and cond.terminating is True
        if ready and not terminating:
            found |= {join_host_port(a, port) for a in ep.addresses or []}
    return found


def watch_endpoint_slices(settings: SchedulerSettings, publish: Callable[[set[str]], None],
                          stop: threading.Event | None = None) -> None:
    """Runs for the process's life (or until `stop` is set): every change of the executor set is published,
    whole."""
    api = client.DiscoveryV1Api(api_client(settings.kubeconfig))
    ns, selector, port_name = namespace(settings), settings.kubernetes_label_selector, settings.kubernetes_port_name
    log.info("watching EndpointSlices in namespace %s with selector %r", ns, selector)
    stop = stop or threading.Event()
    while not stop.is_set():
        try:
            listed = api.list_namespaced_endpoint_slice(ns, label_selector=selector)
            slices = {s.metadata.name: executors_of(s, port_name) for s in listed.items}
            publish(set().union(*slices.values()))
            version = listed.metadata.resource_version
            while not stop.is_set():
                w = watch.Watch()
                # The server ends a watch after timeout_seconds; the client's read timeout catches a connection
                # that died without a word (an API server failover, a NAT's idle timeout), which would
                # otherwise leave discovery blind for ever.
                for event in w.stream(api.list_namespaced_endpoint_slice, ns, label_selector=selector,
                                      resource_version=version, allow_watch_bookmarks=True,
                                      timeout_seconds=settings.kubernetes_watch_seconds,
                                      _request_timeout=(10, settings.kubernetes_watch_seconds + WATCH_SLACK_SECONDS)):
                    s = event["object"]
                    version = s.metadata.resource_version
                    if event["type"] == "BOOKMARK":
                        continue
                    if event["type"] == "DELETED":
                        slices.pop(s.metadata.name, None)
                    else:
                        slices[s.metadata.name] = executors_of(s, port_name)
                    publish(set().union(*slices.values()))
        except ApiException as e:
            if e.status == 410:
                log.info("EndpointSlice watch expired (410 Gone); listing again")
                continue
            log.warning("EndpointSlice list/watch failed: %s %s; retrying", e.status, e.reason)
        except Exception as e:  # noqa: BLE001 - a broken connection must not end discovery
            log.warning("EndpointSlice list/watch failed: %s; retrying", e)
        stop.wait(settings.retry_seconds)
