"""--quantization int8|int4: a float checkpoint quantized at load into GGUF's blocks (Q8_0; Q4_1 with the embedding
and head in Q8_0) by the gguf package's reference quantizer, then multiplied as they are. The quantized model's
tokens and log-probabilities are, to the bit, those of a float model holding the dequantized values."""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_gguf_quantized_model import engine_logits  # noqa: E402
from tiny_model import write_tiny_llama  # noqa: E402

from executor_service.model.loader import load_model  # noqa: E402
from executor_service.model.quantize_at_load import SCHEMES, VOCAB_TENSORS  # noqa: E402

TIE = {"tied": True, "untied": False}


def dequantized_copy(model: Path, out: Path, scheme: str) -> Path:
    """`model` with every matrix replaced by the values its blocks in `scheme` dequantize to, in float32."""
    out.mkdir()
    (out / "config.json").write_text((model / "config.json").read_text())
    tensors = load_file(str(model / "model.safetensors"))
    for name, w in tensors.items():
        if w.dim() == 2:
            t = GGMLQuantizationType[SCHEMES[scheme][1 if name in VOCAB_TENSORS else 0]]
            blocks = quantize(w.float().numpy(), t)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, t), dtype=np.float32))
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_matrix_is_held_in_the_blocks_the_reference_quantizer_writes(tmp_path, scheme):
    model = write_tiny_llama(tmp_path / "m", tie_word_embeddings=False, hidden_size=64, intermediate_size=128,
                             vocab_size=128)
    m = load_model(model, 128, "cpu", torch.float32, quantization=scheme)
    raw = load_file(str(model / "model.safetensors"))
    proj, vocab = (GGMLQuantizationType[f] for f in SCHEMES[scheme])
    layer = m.layers[1]
    qkv = torch.cat([raw[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]).numpy()
    want = dequantize(quantize(qkv, proj), proj)
    assert layer.qkv_proj.packed.fmt == proj.name and m.lm_head.packed.fmt == vocab.name
    assert np.array_equal(layer.qkv_proj.packed.dequantized().numpy(), want)
    head = raw["lm_head.weight"].numpy()
    assert np.array_equal(m.lm_head.packed.dequantized().numpy()[:head.shape[0]], dequantize(quantize(head, vocab),
                                                                                            vocab))
    assert not np.array_equal(want, qkv)        # it did quantize


@pytest.mark.parametrize("tie", TIE)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_quantized_at_load_gives_the_tokens_of_its_dequantized_values_to_the_bit(tmp_path, scheme, dtype,
                                                                                          tie):
    model = write_tiny_llama(tmp_path / "m", tie_word_embeddings=TIE[tie], hidden_size=64, intermediate_size=128,
                             vocab_size=128)
    engine, got = engine_logits(model, scheme, dtype)
    _, want = engine_logits(dequantized_copy(model, tmp_path / "d", scheme), "none", dtype)
    assert got == want
    _, plain = engine_logits(model, "none", dtype)
    assert plain != got            # the weights did change: the test compares something
    runner = engine.runner
    assert runner.describe()["quantization"] == scheme and runner.kv_layout.endswith(f":{scheme}")
    assert type(runner.model.embed_tokens).__name__ == "QuantizedEmbedding"


def test_a_matrix_whose_width_the_blocks_do_not_divide_stays_in_float(tmp_path, caplog):
    # hidden 48: q/k/v, gate/up and the embedding are 48 wide; down_proj is 64 wide and is quantized
    model = write_tiny_llama(tmp_path / "m", hidden_size=48, intermediate_size=64, vocab_size=128)
    engine, got = engine_logits(model, "int8", "float32")
    layer = engine.runner.model.layers[0]
    assert type(layer.down_proj.packed).__name__ == "QuantizedLinear"
    assert type(layer.qkv_proj.packed).__name__ == "PackedLinear"
    assert type(engine.runner.model.embed_tokens).__name__ == "Embedding"


def test_int8_perplexity_stays_within_a_percent_of_the_float_models(tmp_path):
    from executor_service.model.teacher_forced import perplexity

    model = write_tiny_llama(tmp_path / "m", hidden_size=64, intermediate_size=128,
                             vocab_size=128)
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(3, 97, (64,), generator=g) for _ in range(3)]
    ppl = {}
    for q in ("none", "int8", "int4"):
        m = load_model(model, 128, "cpu", torch.float32, quantization=q)
        m.pack_linears()
        ppl[q] = perplexity(m, windows)
    assert abs(ppl["int8"] / ppl["none"] - 1) < 0.01
    assert ppl["int4"] != ppl["none"]
