"""LoRA adapters through the real services: listed in /v1/models, picked by `model` from the openai SDK and gRPC
with transformers + peft's greedy tokens, loaded and unloaded at run time behind the API key while traffic runs
(no request lost, no block leaked), and every bad adapter refused at load with a 400 that leaves the executor
serving what it served."""

from __future__ import annotations

import importlib.util
import json
import os
import threading

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
grpc = pytest.importorskip("grpc")
torch = pytest.importorskip("torch")
if importlib.util.find_spec("peft") is None:   # found, not imported: 2 s in every worker collecting this file
    pytest.skip("peft is not installed", allow_module_level=True)

from helpers import wait_executor_idle  # noqa: E402
from lora_fixtures import make_adapter as fixtures_make_adapter  # noqa: E402
from lora_fixtures import peft_greedy, peft_reference  # noqa: E402
from shallow_model import SHALLOW  # noqa: E402

from launcher.processes import Service  # noqa: E402
from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from stepwire.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`

KEY = "sk-lora-test"
BASE = "SmolLM2-135M-Instruct"
PROMPT = [1, 504, 3458, 282, 1029, 314, 1789, 30, 216]
TOKENS = 10
TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")


def make_adapter(path, seed: int, rank: int = 8) -> list[int]:
    """A random PEFT adapter saved at `path`, and its greedy continuation of PROMPT under transformers + peft."""
    return peft_greedy(peft_reference(fixtures_make_adapter(path, seed, rank, TARGETS, base=SHALLOW), SHALLOW),
                       PROMPT, TOKENS)


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory, shallow):
    """The embedded model's first layers (conftest.shallow) under its own name, with adapters of them."""
    from launcher.processes import Stack
    root = tmp_path_factory.mktemp("adapters")
    expected = {f"a{i}": make_adapter(root / f"a{i}", seed=i) for i in range(3)}
    # The peft reference decodes in float32; so does the executor here, whatever the machine's default.
    env = {"STEPWIRE_EXECUTOR_DTYPE": "float32"}
    services = [Service("executor", flags={"--model": SHALLOW, "--kv-cache-memory": 128 << 20, "--max-model-len": 1024,
                                           "--max-loras": 2, "--max-cpu-loras": 2, "--lora-dir": root}, env=env),
                Service("scheduler", flags={"--lora-modules": f"a0={root / 'a0'}"}),
                Service("gateway", flags={"--model": SHALLOW, "--served-model-name": BASE},
                        env={"STEPWIRE_API_KEY": KEY})]
    with Stack(services, tmp_path_factory.mktemp("lora-logs")) as stack:
        url = stack["gateway"].url
        stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(stack["scheduler"].flags["--address"]))
        yield url, stub, stack, root, expected


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def _generate(stack, model: str):
    channel = grpc.insecure_channel(stack["gateway"].flags["--grpc-address"])
    try:
        return generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(model=model, token_ids=generation_pb2.TokenIds(ids=PROMPT),
                                           params=generation_pb2.SamplingParameters(
                                               max_tokens=TOKENS, temperature=0, ignore_eos=True)),
            metadata=(("authorization", f"Bearer {KEY}"),), timeout=120).completions[0]
    finally:
        channel.close()


def _tokens(stack, model: str) -> list[int]:
    return list(_generate(stack, model).token_ids)


def _post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def test_a_start_adapter_is_listed_with_its_base_and_answers_with_peft_tokens(lora_stack):
    url, _, stack, root, expected = lora_stack
    client = _client(url)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {BASE, "a0"}
    assert cards["a0"].model_dump()["parent"] == BASE and cards["a0"].model_dump()["root"] == str(root / "a0")
    assert _tokens(stack, "a0") == expected["a0"]
    assert _tokens(stack, BASE) != expected["a0"]      # the adapter changes the output
    # The openai SDK picks it by `model` too, and gets the same text.
    r = client.completions.create(model="a0", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.model == "a0" and r.choices[0].text == _generate(stack, "a0").text


def test_an_unknown_model_is_404_model_not_found_over_http_and_not_found_over_grpc(lora_stack):
    url, _, stack, _, _ = lora_stack
    with pytest.raises(openai.NotFoundError) as e:
        _client(url).completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    channel = grpc.insecure_channel(stack["gateway"].flags["--grpc-address"])
    with pytest.raises(grpc.RpcError) as e:
        generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(model="no-such-adapter", text="Hi"), metadata=(("authorization",
                                                                                          f"Bearer {KEY}"),))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def _bad_adapters(root, tmp) -> dict[str, str]:
    """Adapter directories each wrong in one way, by what the 400 must say."""
    import shutil
    bad = {}
    big = root / "rank-too-high"
    make_adapter(big, seed=9, rank=32)          # the executor takes rank 16 at most (--max-lora-rank default)
    bad["above --max-lora-rank"] = str(big)
    shutil.copytree(root / "a1", tmp / "outside")
    corrupt = root / "corrupt"
    shutil.copytree(root / "a1", corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    bad["cannot be read"] = str(corrupt)
    lm_head = root / "lm-head"
    shutil.copytree(root / "a1", lm_head)
    cfg = json.loads((lm_head / "adapter_config.json").read_text())
    cfg["target_modules"] = ["lm_head", "q_proj"]
    (lm_head / "adapter_config.json").write_text(json.dumps(cfg))
    bad["are not supported"] = str(lm_head)
    missing = root / "missing-targets"
    shutil.copytree(root / "a1", missing)
    cfg = json.loads((missing / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj", "gate_proj", "down_proj", "o_proj"]   # o_proj has no weights
    (missing / "adapter_config.json").write_text(json.dumps(cfg))
    bad["have no weights"] = str(missing)
    bad["outside the adapter directory"] = str(tmp / "outside")
    os.symlink(tmp, root / "link-out")
    bad["outside the adapter directory "] = str(root / "link-out" / "outside")
    bad["no adapter_config.json"] = str(root)
    return bad


def test_bad_adapters_are_refused_at_load_with_a_400_and_the_executor_serves_as_before(lora_stack, tmp_path):
    url, stub, stack, root, expected = lora_stack
    for why, path in _bad_adapters(root, tmp_path).items():
        r = _post(url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert r.status_code == 400, (why, r.text)
        assert why.strip() in r.json()["error"]["message"], (why, r.text)
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": str(root / "a1")}).status_code == 400
    assert "bad" not in {m.id for m in _client(url).models.list().data}
    assert _tokens(stack, "a0") == expected["a0"]
    wait_executor_idle(stub, seconds=20)


def test_loading_and_unloading_need_the_api_key(lora_stack):
    url, _, _, root, _ = lora_stack
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "a1")}, key=None)
    assert r.status_code == 401
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "a0"}, key="sk-wrong").status_code == 401


def test_load_use_unload_and_reload_under_traffic_lose_no_request_and_leak_no_block(lora_stack):
    url, stub, stack, root, expected = lora_stack
    client = _client(url)
    stop, failures, done = threading.Event(), [], []

    def traffic(model: str):
        while not stop.is_set():
            try:
                got = _tokens(stack, model)
                if model == "a0" and got != expected["a0"]:
                    failures.append(f"a0 gave {got}")
                done.append(model)
            except Exception as e:   # noqa: BLE001 -- collected, asserted below
                failures.append(f"{model}: {e!r}")

    threads = [threading.Thread(target=traffic, args=(m,)) for m in ("a0", BASE, "a0")]
    for t in threads:
        t.start()
    try:
        for _ in range(2):
            assert _post(url, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": "a1"}).status_code == 200
            assert _tokens(stack, "a1") == expected["a1"]
            r = _post(url, "/v1/unload_lora_adapter", {"lora_name": "a1"})
            assert r.status_code == 200, r.text
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="a1", prompt=PROMPT, max_tokens=2)
            assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "a1"}).status_code == 404
        # The same name from another directory: its own weights, never the old ones (host memory, slots, cache).
        assert _post(url, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": "a2"}).status_code == 200
        assert _tokens(stack, "a1") == expected["a2"]
        # A third adapter with two slots, both in use by traffic at times: it waits for a slot, then runs.
        assert _post(url, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": "a1"}).status_code == 200
        assert _tokens(stack, "a3") == expected["a1"]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not failures, failures[:5]
    assert done.count("a0") >= 2 and BASE in done
    stats = wait_executor_idle(stub, seconds=30)
    assert len(stats.lora_slots) == 2
    for name in ("a1", "a3"):
        _post(url, "/v1/unload_lora_adapter", {"lora_name": name})


def test_an_adapter_whose_file_breaks_after_its_check_is_dropped_and_only_its_requests_fail(lora_stack):
    import shutil
    url, stub, stack, root, expected = lora_stack
    shutil.copytree(root / "a1", root / "breaks")
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "breaks", "lora_path": "breaks"}).status_code == 200
    (root / "breaks" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(grpc.RpcError) as e:
        _generate(stack, "breaks")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no longer be read" in e.value.details()
    assert "breaks" not in {m.id for m in _client(url).models.list().data}
    assert _tokens(stack, "a0") == expected["a0"]       # the executor serves on, the other adapters unchanged
    wait_executor_idle(stub, seconds=30)


def test_an_adapter_loaded_at_run_time_survives_a_scheduler_restart_mid_stream(lora_stack):
    """A new scheduler knows only its --lora-modules; the gateway loads the rest again before it resubmits the
    requests it held, so a stream under a run-time adapter goes on with the tokens it would have had."""
    import signal
    url, stub, stack, root, expected = lora_stack
    client = _client(url)
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": "a2"}).status_code == 200
    kw = {"model": "rt", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kw).choices[0].text
    text, restarted = "", False
    for chunk in client.completions.create(stream=True, **kw):
        text += chunk.choices[0].text if chunk.choices else ""
        if text and not restarted:
            stack.restart("scheduler", signal.SIGKILL, pause=0.5)
            restarted = True
    assert restarted and text == whole
    assert "rt" in {m.id for m in client.models.list().data}
    stack.wait_ready("scheduler")
    fresh = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(stack["scheduler"].flags["--address"]))
    assert {a.name for a in fresh.Adapters(scheduler_pb2.AdaptersRequest()).adapters} >= {"a0", "rt"}
    _post(url, "/v1/unload_lora_adapter", {"lora_name": "rt"})
