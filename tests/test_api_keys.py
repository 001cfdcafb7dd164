"""API keys at the gateway: Bearer keys on HTTP and gRPC from a file (re-read when it changes) and from
STEPWIRE_API_KEY; health and metrics stay open, also on a port of their own; and a gateway reachable from
the network refuses to start without a key unless told --insecure."""

import os

import grpc
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from helpers import free_port, wait_until  # noqa: E402

from gateway.access import auth, watched_file  # noqa: E402
from gateway.access.auth import ApiKeys, bearer, require_key_beyond_loopback  # noqa: E402
from launcher.processes import Service, flag_dict  # noqa: E402

NAME = "model"
HANG = 20
FILE_KEYS = "# the gateway's keys\nsk-file-one\n\n   sk-file-two  \n# sk-commented-out\n"
ENV_KEYS = "sk-env-one, sk-env-two,"


# --- the key set -----------------------------------------------------------------------------------------------

pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(watched_file.time, "monotonic", c)
    return c


def test_keys_come_from_the_file_without_comments_or_blank_lines_and_from_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text(FILE_KEYS)
    keys = ApiKeys(str(f), ENV_KEYS)
    for good in ("sk-file-one", "sk-file-two", "sk-env-one", "sk-env-two"):
        assert keys.check(good), good
    for bad in ("sk-commented-out", "# the gateway's keys", "", None, "sk-file-on", "sk-file-one ", " "):
        assert not keys.check(bad), bad


def test_no_key_anywhere_means_no_authentication_and_either_source_alone_turns_it_on(tmp_path):
    assert not ApiKeys("", "").enabled
    assert not ApiKeys("", " , ").enabled
    assert ApiKeys("", "k").enabled
    (tmp_path / "keys").write_text("k\n")
    assert ApiKeys(str(tmp_path / "keys"), "").enabled


def test_the_environment_variable_is_exactly_stepwire_api_key(monkeypatch):
    monkeypatch.setenv("STEPWIRE_GATEWAY_API_KEY", "wrong-prefix")
    monkeypatch.delenv("STEPWIRE_API_KEY", raising=False)
    assert not ApiKeys("").enabled
    monkeypatch.setenv("STEPWIRE_API_KEY", "a,b")
    assert ApiKeys("").check("b") and not ApiKeys("").check("wrong-prefix")


def test_every_key_is_compared_in_constant_time_whichever_one_matches(monkeypatch):
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    keys = ApiKeys("", "first,second,third-and-much-longer")
    for presented in ("first", "third-and-much-longer", "none-of-them", "x"):
        calls.clear()
        keys.check(presented)
        # No early exit at a match, and digests of one length whatever the keys' lengths.
        assert calls == [(32, 32)] * 3, presented


def test_a_changed_key_file_is_read_again_but_no_more_than_once_a_second(tmp_path, clock, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("old\n")
    keys = ApiKeys(str(f), "")
    reads = []
    reload = keys._file._reload
    monkeypatch.setattr(keys._file, "_reload", lambda: reads.append(clock.now) or reload())
    f.write_text("new\n")
    clock.now += 0.5
    assert keys.check("old") and not keys.check("new")         # within the second: not looked at yet
    assert reads == []
    clock.now += 0.6
    assert keys.check("new") and not keys.check("old")
    for _ in range(100):
        keys.check("new")
    assert len(reads) == 1


def test_a_rotated_kubernetes_secret_is_picked_up(tmp_path, clock):
    # A Secret volume: keys -> ..data/keys, ..data -> ..<timestamp>; rotation swaps ..data at once.
    for version, key in (("..v1", "first"), ("..v2", "second")):
        (tmp_path / version).mkdir()
        (tmp_path / version / "keys").write_text(key + "\n")
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "keys").symlink_to("..data/keys")
    keys = ApiKeys(str(tmp_path / "keys"), "")
    assert keys.check("first")
    (tmp_path / "..data_tmp").symlink_to("..v2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    clock.now += 1.1
    assert keys.check("second") and not keys.check("first")


def test_a_key_file_that_vanishes_keeps_the_old_keys_and_one_that_empties_refuses_everyone(tmp_path, clock):
    f = tmp_path / "keys"
    f.write_text("k\n")
    keys = ApiKeys(str(f), "")
    f.unlink()
    clock.now += 2
    assert keys.check("k")
    f.write_text("# all keys revoked\n")
    clock.now += 2
    assert keys.enabled and not keys.check("k") and not keys.check("")


@pytest.mark.parametrize("content", [None, "", "# only a comment\n\n"], ids=["missing", "empty", "comments only"])
def test_a_key_file_without_keys_stops_the_gateway_at_start(tmp_path, content):
    f = tmp_path / "keys"
    if content is not None:
        f.write_text(content)
    with pytest.raises(SystemExit) as e:
        ApiKeys(str(f), "")
    assert str(f) in str(e.value.code)


@pytest.mark.parametrize("value, key", [("Bearer k", "k"), ("bearer k", "k"), ("BEARER  k ", "k"), ("Bearer", None),
                                        ("Bearer ", None), ("Basic k", None), ("k", None), (None, None), ("", None)])
def test_only_a_bearer_credential_is_a_key(value, key):
    assert bearer(value) == key


@pytest.mark.parametrize("addresses, refused", [
    (["127.0.0.1", "127.0.0.1:50050"], False), (["localhost", "localhost:50050"], False),
    (["127.0.0.9", "[::1]:50050"], False), (["::1", "127.0.0.1:1"], False),
    (["0.0.0.0", "127.0.0.1:50050"], True), (["127.0.0.1", "0.0.0.0:50050"], True),
    (["::", "127.0.0.1:1"], True), (["127.0.0.1", "[::]:50050"], True), (["10.1.2.3", "127.0.0.1:1"], True),
    (["127.0.0.1", ":50050"], True), (["gateway.example.com", "127.0.0.1:1"], True),
])
def test_an_api_beyond_loopback_needs_a_key_or_insecure(addresses, refused):
    if refused:
        with pytest.raises(SystemExit) as e:
            require_key_beyond_loopback(addresses, ApiKeys("", ""), insecure=False)
        assert "--insecure" in str(e.value.code) and "STEPWIRE_API_KEY" in str(e.value.code)
    else:
        require_key_beyond_loopback(addresses, ApiKeys("", ""), insecure=False)
    require_key_beyond_loopback(addresses, ApiKeys("", "k"), insecure=False)
    require_key_beyond_loopback(addresses, ApiKeys("", ""), insecure=True)


# --- the gateway process ---------------------------------------------------------------------------------------

def gateway(launch, args: list[str]):
    """A gateway alone (no scheduler), with no STEPWIRE_API_KEY in its environment; it reads only the
    embedded model's tokenizer."""
    from gateway_stack import EMBEDDED

    if not (EMBEDDED / "tokenizer.json").exists():
        pytest.skip("embedded model not prepared (make model)")
    return launch(Service("gateway", flags={"--model": EMBEDDED, "--scheduler": f"127.0.0.1:{free_port()}",
                                            **flag_dict(args)}, env={"STEPWIRE_API_KEY": None}), wait=False)


@pytest.mark.parametrize("where", [["--host", "0.0.0.0"], ["--grpc-address", "[::]:0"]], ids=["http", "grpc"])
def test_a_gateway_beyond_loopback_without_a_key_refuses_to_start(launch, where):
    stack = gateway(launch, where)
    assert stack.wait("gateway", 60) != 0
    text = stack.log("gateway").read_text()
    assert "refusing to serve the API" in text and "--insecure" in text, text


def test_with_insecure_a_gateway_beyond_loopback_starts_without_a_key(launch):
    stack = gateway(launch, ["--host", "0.0.0.0", "--insecure"])

    def answers():
        try:
            return httpx.get(stack["gateway"].url + "/health", timeout=1).status_code == 503   # no scheduler
        except httpx.HTTPError:
            return False

    stack.wait_until(answers, "the gateway to answer /health", 60)


# --- a stack with keys -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    pytest.importorskip("torch")
    from gateway_stack import tiny_stack

    tmp = tmp_path_factory.mktemp("keys")
    key_file = tmp / "api-keys"
    key_file.write_text(FILE_KEYS)
    health_port = free_port()
    with tiny_stack(tmp, ["--api-key-file", str(key_file), "--health-port", str(health_port)],
                    env={"STEPWIRE_API_KEY": ENV_KEYS}) as s:
        yield s, key_file, f"http://127.0.0.1:{health_port}"


def complete(url: str, key: str | None = None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}, headers=headers,
                      timeout=HANG, **kw)


def test_http_without_a_key_is_401_as_openai_answers_it(keyed):
    r = complete(keyed[0].url)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {"error": {"message": auth.MISSING, "type": "invalid_request_error", "param": None,
                                  "code": None}}


@pytest.mark.parametrize("key", ["sk-wrong", "sk-file-one-and-more", "sk-commented-out", "sk-env-one,sk-env-two"])
def test_http_with_a_wrong_key_is_401_invalid_api_key(keyed, key):
    r = complete(keyed[0].url, key)
    assert r.status_code == 401
    assert r.json() == {"error": {"message": auth.INCORRECT, "type": "invalid_request_error", "param": None,
                                  "code": "invalid_api_key"}}


@pytest.mark.parametrize("key", ["sk-file-one", "sk-file-two", "sk-env-one", "sk-env-two"])
def test_http_with_any_of_the_keys_is_served(keyed, key):
    r = complete(keyed[0].url, key)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def test_tokenize_and_detokenize_are_served_with_a_key(keyed):
    auth = {"Authorization": "Bearer sk-file-one"}
    tokens = httpx.post(keyed[0].url + "/tokenize", json={"prompt": "Hi"}, headers=auth, timeout=HANG).json()["tokens"]
    r = httpx.post(keyed[0].url + "/detokenize", json={"tokens": tokens}, headers=auth, timeout=HANG)
    assert r.status_code == 200 and r.json() == {"prompt": "Hi"}, r.text


def test_the_openai_client_authenticates_with_its_api_key(keyed):
    url = keyed[0].url + "/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url, api_key="sk-env-two", max_retries=0)
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2).usage.completion_tokens >= 1


def test_every_api_path_needs_a_key_even_one_that_does_not_exist(keyed):
    url = keyed[0].url
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/nothing"),
                         ("GET", "/openapi.json"), ("POST", "/tokenize"), ("POST", "/detokenize")]:
        assert httpx.request(method, url + path, timeout=HANG).status_code == 401, path


def test_a_caller_without_a_key_is_refused_before_its_body_is_read(keyed):
    # 401, not 413: the key is checked first, so an oversized body costs nothing.
    r = httpx.post(keyed[0].url + "/v1/completions", content=b"x" * (3 << 20), timeout=HANG)
    assert r.status_code == 401


def test_health_and_metrics_need_no_key_on_the_api_port_and_on_the_health_port(keyed):
    stack, _, health = keyed
    for root in (stack.url, health):
        assert httpx.get(root + "/health", timeout=HANG).json() == {"status": "ok"}
        metrics = httpx.get(root + "/metrics", timeout=HANG)
        assert metrics.status_code == 200 and "gateway_requests_total" in metrics.text


def test_the_health_port_serves_nothing_but_health_and_metrics(keyed):
    health = keyed[2]
    assert httpx.post(health + "/v1/completions", json={"model": NAME, "prompt": "Hi"}, timeout=HANG).status_code \
        == 404
    assert httpx.get(health + "/v1/models", timeout=HANG).status_code == 404


def grpc_calls(channel):
    from stepwire.v1 import generation_pb2 as g
    from stepwire.v1 import generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(channel)
    request = g.GenerateRequest(text="Hi", params=g.SamplingParameters(max_tokens=2))
    return {"Generate": lambda **kw: stub.Generate(request, timeout=HANG, **kw),
            "GenerateStream": lambda **kw: list(stub.GenerateStream(request, timeout=HANG, **kw)),
            "Tokenize": lambda **kw: stub.Tokenize(g.TokenizeRequest(text="Hi"), timeout=HANG, **kw),
            "ModelInfo": lambda **kw: stub.ModelInfo(g.ModelInfoRequest(), timeout=HANG, **kw)}


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer sk-wrong")], [("authorization", "sk-file-one")]],
                         ids=["no key", "wrong key", "not a bearer credential"])
def test_grpc_without_a_right_key_is_unauthenticated_on_every_method(keyed, metadata):
    with grpc.insecure_channel(keyed[0].grpc) as channel:
        for name, call in grpc_calls(channel).items():
            with pytest.raises(grpc.RpcError) as e:
                call(metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, name


def test_grpc_reflection_needs_a_key_too(keyed):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(keyed[0].grpc) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([request]), timeout=HANG))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = list(stub.ServerReflectionInfo(iter([request]), timeout=HANG,
                                                metadata=[("authorization", "Bearer sk-file-two")]))
        assert "stepwire.v1.Generation" in {s.name for s in answer[0].list_services_response.service}


@pytest.mark.parametrize("key", ["sk-file-one", "sk-env-two"])
def test_grpc_with_a_key_is_served_and_health_needs_none(keyed, key):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(keyed[0].grpc) as channel:
        for name, call in grpc_calls(channel).items():
            assert call(metadata=[("authorization", f"Bearer {key}")]), name
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=HANG).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_rotated_key_file_takes_effect_without_a_restart(keyed):
    stack, key_file, _ = keyed
    replacement = key_file.with_name("api-keys.new")
    try:
        replacement.write_text("sk-rotated\n")
        os.replace(replacement, key_file)   # at once, as a Secret volume swaps its files
        wait_until(lambda: complete(stack.url, "sk-rotated").status_code == 200, 30, "the rotated key to be accepted",
                   procs=stack.gateway, logs=stack.logs)
        assert complete(stack.url, "sk-file-one").status_code == 401
        assert complete(stack.url, "sk-env-one").status_code == 200      # the environment's keys stay
        with grpc.insecure_channel(stack.grpc) as channel:
            assert grpc_calls(channel)["Tokenize"](metadata=[("authorization", "Bearer sk-rotated")])
    finally:
        replacement.write_text(FILE_KEYS)
        os.replace(replacement, key_file)
    wait_until(lambda: complete(stack.url, "sk-file-one").status_code == 200, 30, "the original keys back")
    assert stack.gateway.poll() is None
