"""The CPU executor's linear layers on fixed_order's GEMM over packed weights (`--cpu-gemm`): the tokens of the
library's path, and a clear refusal or fallback where the kernels cannot serve."""

import pytest

torch = pytest.importorskip("torch")

from tiny_model import chunked_and_cached_prompts, reference_greedy, write_tiny_llama  # noqa: E402

from executor_service.engine.runner_config import RunnerConfig, uses_packed_gemm  # noqa: E402

pytestmark = pytest.mark.model


def test_packed_weights_give_the_librarys_greedy_tokens_in_float32_and_drop_the_unpacked_copy(tmp_path):
    from executor_service.engine.runner import ModelRunner
    model = write_tiny_llama(tmp_path)
    prompts = chunked_and_cached_prompts()
    library = reference_greedy(model, prompts, dtype="float32", cpu_gemm="library")
    assert reference_greedy(model, prompts, dtype="float32", cpu_gemm="packed") == library
    runner = ModelRunner(RunnerConfig(str(model), dtype="float32", cpu_gemm="packed", kv_cache_memory=1 << 20))
    layer = runner.model.layers[0]
    assert layer.qkv_proj.packed is not None and layer.qkv_proj.weight.numel() == 0
    assert not layer.fixed     # only the GEMMs: attention and norms stay torch's outside deterministic mode
    lib = ModelRunner(RunnerConfig(str(model), dtype="float32", cpu_gemm="library", kv_cache_memory=1 << 20))
    assert lib.model.layers[0].qkv_proj.packed is None


def test_packed_gemm_refuses_a_dtype_it_does_not_take_and_auto_falls_back(tmp_path):
    cfg = RunnerConfig(str(tmp_path), cpu_gemm="packed")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        uses_packed_gemm(cfg, torch.float16)
    assert not uses_packed_gemm(RunnerConfig(str(tmp_path)), torch.float16)
    assert uses_packed_gemm(RunnerConfig(str(tmp_path)), torch.float32)
    assert not uses_packed_gemm(RunnerConfig(str(tmp_path), cpu_gemm="library"), torch.float32)


def test_without_a_c_compiler_auto_keeps_the_library_and_packed_refuses(tmp_path, monkeypatch):
    from executor_service.kernels import fixed_order
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("STEPWIRE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("STEPWIRE_FIXED_ORDER_ARCH", "x86-64")    # a build no earlier test cached
    fixed_order.library.cache_clear()
    try:
        assert not uses_packed_gemm(RunnerConfig(str(tmp_path)), torch.float32)
        with pytest.raises(fixed_order.FixedOrderUnavailable, match="C compiler"):
            uses_packed_gemm(RunnerConfig(str(tmp_path), cpu_gemm="packed"), torch.float32)
    finally:
        fixed_order.library.cache_clear()
