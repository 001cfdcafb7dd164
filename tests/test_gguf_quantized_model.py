"""A GGUF's quantized weights through the whole path: tools.convert_gguf keeps their blocks (quantized.safetensors,
beside the dequantized model.safetensors), and an executor with --quantization gguf multiplies them as they are.
Its logits are, to the bit, those of the same directory loaded dequantized (both on the packed GEMM)."""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf.quants import quantize  # noqa: E402
from safetensors import safe_open  # noqa: E402

from executor_service.model.config import ModelLoadError  # noqa: E402
from tools.convert_gguf import convert  # noqa: E402
from tools.gguf_tokenizer import byte_alphabet  # noqa: E402

HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS


def _permute(rows, heads):      # llama.cpp's Q/K row order for a Llama
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(rows.shape).copy()


def write_gguf(path: Path, types: dict[str, str], layers: int = 2, seed: int = 0) -> Path:
    """A small Llama in llama.cpp's layout, each tensor named in `types` ("attn_q", "token_embd", ...) stored in
    that GGUF type, the others float32."""
    tokens = ["<|endoftext|>", *byte_alphabet().values(), "Ġt"]
    rng = np.random.default_rng(seed)
    rand = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    stored = {"token_embd.weight": rand(len(tokens), HIDDEN), "output_norm.weight": 1 + rand(HIDDEN)}
    for i in range(layers):
        b = f"blk.{i}."
        stored |= {b + "attn_norm.weight": 1 + rand(HIDDEN), b + "ffn_norm.weight": 1 + rand(HIDDEN),
                   b + "attn_q.weight": _permute(rand(HIDDEN, HIDDEN), HEADS),
                   b + "attn_k.weight": _permute(rand(KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS),
                   b + "attn_v.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                   b + "attn_output.weight": rand(HIDDEN, HIDDEN),
                   b + "ffn_gate.weight": rand(FFN, HIDDEN), b + "ffn_up.weight": rand(FFN, HIDDEN),
                   b + "ffn_down.weight": rand(HIDDEN, FFN)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    for name, values in stored.items():
        kind = types.get(name.split(".")[-2]) if name.startswith("blk.") else types.get(name.split(".")[0])
        if kind is None:
            w.add_tensor(name, values)
        else:
            t = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, quantize(values, t), raw_shape=quantize(values, t).shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def engine_logits(model: Path, quantization: str, dtype: str):
    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    from scheduler_service import SchedulerConfig
    from stepwire.contract import SamplingParams

    engine = LLMEngine(RunnerConfig(str(model), dtype=dtype, quantization=quantization, max_num_seqs=4,
                                    max_model_len=128, kv_cache_memory=8 << 20),
                       SchedulerConfig(block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32))
    prompts = [[5, 9, 33, 61, 2, 17, 40, 12, 3, 90, 41, 7, 8, 8, 100, 120, 31, 44, 6, 1, 13], [77, 3, 19]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    rids = [engine.add_request(p, params) for p in prompts]
    out = {r: [] for r in rids}
    while engine.has_unfinished():
        for d in engine.step():
            out[d.req_id].append((list(d.new_token_ids), repr(d.logprobs)))
    assert all(sum(len(t) for t, _ in out[r]) == 10 for r in rids)
    return engine, [out[r] for r in rids]


MIXED = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0", "ffn_gate": "Q8_0",
         "ffn_up": "Q8_0", "ffn_down": "Q4_1", "token_embd": "Q8_0"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gguf_kept_quantized_gives_the_dequantized_models_tokens_and_logprobs_to_the_bit(tmp_path, dtype):
    model = convert(write_gguf(tmp_path / "m.gguf", MIXED), tmp_path / "m")
    with safe_open(str(model / "quantized.safetensors"), framework="np") as f:
        assert len(list(f.keys())) == 2 * 7 + 1      # every projection of both layers and the embedding
    quantized, got = engine_logits(model, "gguf", dtype)
    _, want = engine_logits(model, "none", dtype)
    assert got == want
    runner = quantized.runner
    assert type(runner.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert runner.model.lm_head.packed is runner.model.embed_tokens.table    # tied: one table
    assert runner.describe()["quantization"] == "gguf"


def test_a_fused_layer_in_two_formats_is_loaded_dequantized_and_still_runs(tmp_path, caplog):
    model = convert(write_gguf(tmp_path / "m.gguf", {"attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "Q4_1",
                                                      "ffn_down": "Q4_0"}), tmp_path / "m")
    engine, got = engine_logits(model, "gguf", "float32")
    _, want = engine_logits(model, "none", "float32")
    assert got == want
    layer = engine.runner.model.layers[0]
    assert type(layer.down_proj.packed).__name__ == "QuantizedLinear"
    assert type(layer.qkv_proj.packed).__name__ == "PackedLinear"
    assert "qkv_proj" in caplog.text


def test_a_format_the_kernel_does_not_take_runs_dequantized_and_the_log_names_it(tmp_path, caplog):
    model = convert(write_gguf(tmp_path / "m.gguf", {"ffn_down": "Q5_0", "ffn_gate": "Q8_0", "ffn_up": "Q8_0"}),
                    tmp_path / "m")
    engine, got = engine_logits(model, "gguf", "float32")
    _, want = engine_logits(model, "none", "float32")
    assert got == want
    layer = engine.runner.model.layers[0]
    assert type(layer.down_proj.packed).__name__ == "PackedLinear"
    assert type(layer.gate_up_proj.packed).__name__ == "QuantizedLinear"
    assert "2 weight matrices of the GGUF are in Q5_0" in caplog.text


def test_a_directory_without_quantized_weights_is_refused_with_the_way_out(tmp_path):
    from tiny_model import write_tiny_llama
    with pytest.raises(ModelLoadError, match="quantized.safetensors"):
        engine_logits(write_tiny_llama(tmp_path / "plain"), "gguf", "float32")


def test_a_lora_adapter_on_quantized_base_weights_gives_the_dequantized_models_tokens(tmp_path):
    pytest.importorskip("peft")
    from lora_fixtures import make_adapter

    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    from stepwire.contract import SamplingParams

    model = convert(write_gguf(tmp_path / "m.gguf", MIXED), tmp_path / "m")
    adapter = make_adapter(tmp_path / "adapter", seed=3, rank=4, base=model)
    prompt = [5, 9, 33, 61, 2, 17, 40, 12, 3, 90]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for q in ("gguf", "none"):
        engine = LLMEngine(RunnerConfig(str(model), dtype="float32", quantization=q, max_loras=1, max_lora_rank=8,
                                        max_num_seqs=4, max_model_len=128, kv_cache_memory=8 << 20))
        engine.load_adapter("a", str(adapter))
        got[q] = [c.token_ids for c in engine.generate([prompt, prompt], params, adapters=["a", ""])]
    assert got["gguf"] == got["none"]
    assert got["gguf"][0] != got["gguf"][1]     # the adapter changed the tokens


def test_deterministic_mode_keeps_its_bits_with_quantized_weights(tmp_path):
    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    from stepwire.contract import SamplingParams

    model = convert(write_gguf(tmp_path / "m.gguf", MIXED), tmp_path / "m")
    prompts = [[5, 9, 33, 61, 2, 17, 40, 12, 3, 90], [77, 3, 19]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = {}
    for q in ("gguf", "none"):
        engine = LLMEngine(RunnerConfig(str(model), dtype="float32", quantization=q, deterministic=True,
                                        max_num_seqs=4, max_model_len=128, kv_cache_memory=8 << 20))
        got[q] = [c.token_ids for c in engine.generate(prompts, params)]
        alone = [engine.generate([p], params)[0].token_ids for p in prompts]
        assert alone == got[q]
    assert got["gguf"] == got["none"]


def test_auto_takes_the_quantized_weights_only_where_they_are_the_fastest_way(tmp_path):
    from tiny_model import write_tiny_llama

    from executor_service.engine.runner_config import RunnerConfig, resolve_quantization

    model = convert(write_gguf(tmp_path / "m.gguf", MIXED), tmp_path / "m")
    cpu, auto = torch.device("cpu"), dict(quantization="auto")
    assert resolve_quantization(RunnerConfig(str(model), **auto), cpu, torch.float32) == "gguf"
    assert resolve_quantization(RunnerConfig(str(model), **auto), cpu, torch.bfloat16) == "none"
    assert resolve_quantization(RunnerConfig(str(model), cpu_gemm="library", **auto), cpu, torch.float32) == "none"
    assert resolve_quantization(RunnerConfig(str(model), **auto), torch.device("cuda"), torch.float32) == "none"
    plain = write_tiny_llama(tmp_path / "plain")
    assert resolve_quantization(RunnerConfig(str(plain), **auto), cpu, torch.float32) == "none"
    assert resolve_quantization(RunnerConfig(str(model), quantization="none"), cpu, torch.float32) == "none"
    engine, _ = engine_logits(model, "auto", "float32")
    assert engine.runner.describe()["quantization"] == "gguf" and engine.runner.kv_layout.endswith(":gguf")
