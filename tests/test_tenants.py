"""Tenants at the gateway: a tenants file maps API keys to tenants and weights (re-read when it changes), the
gateway puts the key's tenant on every request it submits, and the scheduler counts each tenant's tokens and
shares the steps between them."""

from __future__ import annotations

import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from helpers import wait_until  # noqa: E402

from gateway.access import watched_file  # noqa: E402
from gateway.access.auth import ApiKeys, AuthSetupError  # noqa: E402
from gateway.access.tenants import DEFAULT, Tenant, TenantsError, parse_tenants  # noqa: E402

SPEC = {"tenants": {"search": {"keys": ["sk-s1", "sk-s2"], "weight": 3}, "batch-jobs": {"keys": ["sk-b1"]}}}


def test_a_tenants_file_maps_each_key_to_its_tenant_and_weight():
    by_key = parse_tenants(json.dumps(SPEC))
    assert by_key == {"sk-s1": Tenant("search", 3.0), "sk-s2": Tenant("search", 3.0),
                      "sk-b1": Tenant("batch-jobs", 1.0)}


@pytest.mark.parametrize("text, names", [
    ("{not json", "JSON"),
    (json.dumps({"tenants": {"a": {"keys": ["k"], "burst": 3}}}), "burst"),
    (json.dumps({"tenants": {"a": {"keys": ["k"], "weight": 0}}}), "weight"),
    (json.dumps({"tenants": {"a": {"keys": ["k"], "weight": 1001}}}), "weight"),
    (json.dumps({"tenants": {"a": {"keys": []}}}), "keys"),
    (json.dumps({"tenants": {"a": {"keys": ["  "]}}}), "empty key"),
    (json.dumps({"tenants": {"-a": {"keys": ["k"]}}}), "tenant name"),
    (json.dumps({"tenants": {"a" * 65: {"keys": ["k"]}}}), "tenant name"),
    (json.dumps({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}), "both"),
    (json.dumps({"teams": {}}), "tenants"),
])
def test_a_malformed_tenants_file_is_refused_naming_what_is_wrong(text, names):
    with pytest.raises(TenantsError, match=names):
        parse_tenants(text)


def test_keys_of_the_key_file_are_the_default_tenant_and_other_keys_are_refused(tmp_path):
    (tmp_path / "keys").write_text("sk-plain\n")
    (tmp_path / "tenants.json").write_text(json.dumps(SPEC))
    keys = ApiKeys(str(tmp_path / "keys"), env_value="sk-env", tenants_file=str(tmp_path / "tenants.json"))
    assert keys.identify("sk-s2") == Tenant("search", 3.0)
    assert keys.identify("sk-b1") == Tenant("batch-jobs", 1.0)
    assert keys.identify("sk-plain") is DEFAULT and keys.identify("sk-env") is DEFAULT
    assert keys.identify("sk-other") is None and keys.identify("") is None and not keys.check("sk-s")
    # A tenants file alone turns authentication on.
    assert ApiKeys(env_value="", tenants_file=str(tmp_path / "tenants.json")).enabled


@pytest.mark.parametrize("content", [None, "{}", '{"tenants": {"a": {"keys": ["k"], "weight": -1}}}'])
def test_a_tenants_file_that_cannot_be_used_stops_the_gateway_at_start(tmp_path, content):
    path = tmp_path / "tenants.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(AuthSetupError, match="--tenants-file"):
        ApiKeys(env_value="", tenants_file=str(path))


def test_a_changed_tenants_file_is_read_again_and_a_broken_one_keeps_the_tenants_before(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(watched_file.time, "monotonic", lambda: now[0])
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(SPEC))
    keys = ApiKeys(env_value="", tenants_file=str(path))
    spec = {"tenants": {"search": {"keys": ["sk-s3"], "weight": 5}}}
    path.write_text(json.dumps(spec))
    assert keys.identify("sk-s1") == Tenant("search", 3.0), "re-read sooner than once a second"
    now[0] += 1.5
    assert keys.identify("sk-s1") is None and keys.identify("sk-s3") == Tenant("search", 5.0)
    path.write_text('{"tenants": ')          # a half-written file
    now[0] += 1.5
    assert keys.identify("sk-s3") == Tenant("search", 5.0)


# --- through a stack -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tenanted(tmp_path_factory):
    pytest.importorskip("torch")
    from gateway_stack import tiny_stack

    tmp = tmp_path_factory.mktemp("tenants")
    path = tmp / "tenants.json"
    path.write_text(json.dumps(SPEC))
    with tiny_stack(tmp, ["--tenants-file", str(path)], env={"STEPWIRE_API_KEY": "sk-plain"}) as s:
        yield s, path


def complete(url: str, key: str, tokens: int = 4):
    return httpx.post(url + "/v1/completions", json={"model": "model", "prompt": "Hi", "max_tokens": tokens,
                                                     "ignore_eos": True},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


def tenant_tokens(metrics_url: str) -> dict[str, float]:
    got = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith('stepwire:tenant_tokens_total{') and 'kind="generation"' in line:
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            got[tenant] = float(line.rsplit(" ", 1)[1])
    return got


@pytest.mark.processes
def test_each_key_s_tokens_are_counted_for_its_tenant_at_the_scheduler(tenanted):
    s, _ = tenanted
    before = tenant_tokens(s.scheduler_metrics)
    for key, n in (("sk-s1", 3), ("sk-s2", 2), ("sk-b1", 4), ("sk-plain", 1)):
        r = complete(s.url, key, tokens=n)
        assert r.status_code == 200, r.text
    after = tenant_tokens(s.scheduler_metrics)
    grew = {t: after.get(t, 0) - before.get(t, 0) for t in after}
    assert grew == {"search": 5, "batch-jobs": 4, "default": 1}
    assert complete(s.url, "sk-nobody").status_code == 401


@pytest.mark.processes
def test_a_grpc_caller_s_tokens_are_counted_for_its_key_s_tenant(tenanted):
    import grpc

    from stepwire.v1 import generation_pb2 as g
    from stepwire.v1 import generation_pb2_grpc

    s, _ = tenanted
    before = tenant_tokens(s.scheduler_metrics).get("batch-jobs", 0)
    with grpc.insecure_channel(s.grpc) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = g.GenerateRequest(text="Hi", params=g.SamplingParameters(max_tokens=3, ignore_eos=True))
        stub.Generate(request, timeout=60, metadata=[("authorization", "Bearer sk-b1")])
        list(stub.GenerateStream(request, timeout=60, metadata=[("authorization", "Bearer sk-b1")]))
    assert tenant_tokens(s.scheduler_metrics)["batch-jobs"] - before == 6


@pytest.mark.processes
def test_a_tenants_file_rewritten_under_load_takes_effect_and_no_stream_breaks(tenanted):
    s, path = tenanted
    results: list[int] = []

    def load():
        for _ in range(6):
            results.append(complete(s.url, "sk-b1", tokens=8).status_code)

    workers = [threading.Thread(target=load) for _ in range(3)]
    for w in workers:
        w.start()
    spec = {"tenants": {**SPEC["tenants"], "new-team": {"keys": ["sk-n1"], "weight": 2}}}
    path.write_text(json.dumps(spec))
    try:
        wait_until(lambda: complete(s.url, "sk-n1").status_code == 200, timeout=20, what="the new key to work")
        for w in workers:
            w.join(timeout=120)
        assert results == [200] * 18
        assert tenant_tokens(s.scheduler_metrics).get("new-team", 0) >= 4
    finally:
        path.write_text(json.dumps(SPEC))
        time.sleep(1.5)
