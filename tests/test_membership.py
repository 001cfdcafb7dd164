"""Membership sources on their own: the EndpointSlice watch against a fake API server driven through the real
`kubernetes` client, and DNS resolution against a fake name server. (test_fleet.py runs them in a scheduler.)"""

import asyncio
import threading

import pytest

pytest.importorskip("kubernetes")

from fake_discovery import FakeDNS, FakeKubeAPI  # noqa: E402
from helpers import wait_until  # noqa: E402

from scheduler_service.membership import endpoint_slices  # noqa: E402
from scheduler_service.membership.discovery import resolve, resolver  # noqa: E402
from scheduler_service.membership.endpoint_slices import watch_endpoint_slices  # noqa: E402
from scheduler_service.settings import SchedulerSettings  # noqa: E402


def up(ip):
    return {"ip": ip, "ready": True, "serving": True, "terminating": False}


@pytest.fixture
def kube(tmp_path):
    api = FakeKubeAPI()
    yield api
    api.stop()


def test_endpoint_slices_are_listed_then_watched_from_the_lists_version(kube, tmp_path):
    kube.put("ex-a", 7000, [up("10.0.0.1"), up("10.0.0.2"), {"ip": "10.0.0.9", "ready": False}])
    kube.put("other", 7000, [up("10.9.9.9")], service="someone-else")      # outside the label selector
    settings = SchedulerSettings(discovery="kubernetes", kubeconfig=str(kube.kubeconfig(tmp_path)),
                                 kubernetes_namespace="ns", retry_seconds=0.1)
    seen: list[set[str]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_endpoint_slices, args=(settings, seen.append, stop), daemon=True)
    watcher.start()
    now = lambda: seen[-1] if seen else None
    wait_until(lambda: now() == {"10.0.0.1:7000", "10.0.0.2:7000"}, 10, "the listed, ready executors")
    wait_until(lambda: any(c[0] == "watch" for c in kube.calls), 10, "a watch")
    listed_at = kube.version
    assert kube.calls[:2] == [("list", "", "kubernetes.io/service-name=stepwire-executor"),
                              ("watch", str(listed_at), "kubernetes.io/service-name=stepwire-executor")]

    kube.put("ex-b", 7000, [up("10.0.0.3")])                               # a new slice: joins
    wait_until(lambda: now() == {"10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"}, 10, "the new executor")

    kube.expire()                                                          # 410 Gone: list again
    wait_until(lambda: kube.lists() == 2, 10, "a fresh list after 410 Gone")
    kube.put("ex-a", 7000, [{"ip": "10.0.0.1", "ready": False, "serving": True, "terminating": True},
                            up("10.0.0.2")])
    wait_until(lambda: now() == {"10.0.0.2:7000", "10.0.0.3:7000"}, 10, "the terminating one to leave")
    kube.delete("ex-b")
    wait_until(lambda: now() == {"10.0.0.2:7000"}, 10, "the deleted slice's executor to leave")
    # Never the not-ready endpoint, nor the other service's.
    assert not any({"10.0.0.9:7000", "10.9.9.9:7000"} & s for s in seen)
    stop.set()
    kube.expire()                      # ends the open watch, so the thread sees `stop`
    watcher.join(10)
    assert not watcher.is_alive()


def test_a_watch_that_goes_silent_is_given_up_and_the_slices_listed_again(kube, tmp_path, monkeypatch):
    # The slack past the watch's length that a real API server may take to close it: a second is as good a
    # proof here as the production ten.
    monkeypatch.setattr(endpoint_slices, "WATCH_SLACK_SECONDS", 1)
    kube.put("ex-a", 7000, [up("10.0.0.1")])
    kube.silent.set()          # every watch from now on: headers, then silence, never closed
    settings = SchedulerSettings(discovery="kubernetes", kubeconfig=str(kube.kubeconfig(tmp_path)),
                                 kubernetes_namespace="ns", retry_seconds=0.1, kubernetes_watch_seconds=1)
    seen: list[set[str]] = []
    stop = threading.Event()
    threading.Thread(target=watch_endpoint_slices, args=(settings, seen.append, stop), daemon=True).start()
    wait_until(lambda: seen and seen[-1] == {"10.0.0.1:7000"}, 10, "the listed executor")
    wait_until(lambda: any(c[0] == "watch" for c in kube.calls), 10, "a watch")
    kube.put("ex-b", 7000, [up("10.0.0.2")])    # the silent watch never says so: only a fresh list can
    wait_until(lambda: seen[-1] == {"10.0.0.1:7000", "10.0.0.2:7000"}, 40,
               "the client to give up the silent watch and list again")
    assert kube.lists() >= 2
    stop.set()


def test_a_name_resolves_to_one_executor_per_address_and_a_silent_name_server_changes_nothing():
    server = FakeDNS()
    try:
        r = resolver(server.address)
        server.records["executors.test"] = ["10.0.0.1", "10.0.0.2"]
        assert asyncio.run(resolve(r, "executors.test", 50061)) == {"10.0.0.1:50061", "10.0.0.2:50061"}
        # An authoritative "no such name": no executor is ready. A name server that does not answer: unknown.
        assert asyncio.run(resolve(r, "nothing.test", 50061)) == set()
        server.silent = True
        assert asyncio.run(resolve(r, "executors.test", 50061, lifetime=0.5)) is None
    finally:
        server.stop()


def test_dns_discovery_takes_exactly_one_name():
    with pytest.raises(ValueError, match="one name:port"):
        SchedulerSettings(discovery="dns", executors=["a:1", "b:2"])
