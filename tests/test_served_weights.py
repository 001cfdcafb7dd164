"""One model's weights per fleet: an executor whose weights differ from those of the executors already serving
(another quantization that changes the values, or another model) is refused, and joins once they are gone."""

import pytest

from scheduler_service.fleet.served_weights import refusal, weights_of


def test_unquantized_and_gguf_executors_serve_the_same_weights_and_the_others_do_not():
    fleet = {weights_of("/models/SmolLM2/", "none")}
    assert refusal(weights_of("/other/path/SmolLM2", "gguf"), fleet) == ""
    assert refusal(weights_of("/models/SmolLM2", ""), fleet) == ""      # an executor that does not say
    assert refusal(weights_of("/models/SmolLM2", "none"), set()) == ""   # the first sets the fleet's
    for q in ("int8", "int4", "fp8"):
        why = refusal(weights_of("/models/SmolLM2", q), fleet)
        assert q in why and "SmolLM2" in why
    assert "Qwen" in refusal(weights_of("/models/Qwen", "none"), fleet)


@pytest.mark.processes
def test_an_executor_of_other_weights_is_refused_and_joins_once_the_fleets_are_gone(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from fleet_stack import Fleet, Streams

    fleet = Fleet(tmp_path, 2, flags_of={1: ("--quantization", "int8")}, started=1)
    try:
        first, second = fleet.addresses
        fleet.start_executor(1)
        fleet.stack.wait_until(lambda: any(e.refused for e in fleet.stats().executors), "executor 1 refused", 60)
        stats = {e.address: e for e in fleet.stats().executors}
        assert stats[first].connected and stats[first].quantization == "none" and not stats[first].refused
        assert not stats[second].connected and stats[second].quantization == "int8"
        assert "int8" in stats[second].refused and "one model's weights" in stats[second].refused
        s = Streams(fleet.stub, [[5, 6, 7, 8], [9, 10, 11]], max_tokens=6)
        s.join()
        assert s.errors == [None, None] and all(len(t) == 6 for t in s.tokens)
        assert {e.address: e.num_routed for e in fleet.stats().executors}[second] == 0
        fleet.stack.kill("executor-0")
        fleet.wait_connected([second])           # the fleet's weights went with the last of its executors
        s = Streams(fleet.stub, [[5, 6, 7, 8]], max_tokens=6)
        s.join()
        assert s.errors == [None] and len(s.tokens[0]) == 6
        assert not {e.address: e for e in fleet.stats().executors}[second].refused
    finally:
        fleet.stop()
