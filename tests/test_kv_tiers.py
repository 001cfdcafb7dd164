"""KV tiers with real processes (docs/kv_tiers.md): a scheduler and an executor whose pool is small, with a host
tier and a disk tier under it. A prompt whose blocks other prompts pushed out of the pool comes back from a tier
with the same tokens as when it was computed; an executor started again on the same disk directory brings its
blocks back (warm); a block damaged on disk is refused and recomputed, never used."""

import httpx
import pytest

pytest.importorskip("torch")

from fleet_stack import Fleet, Streams, deterministic_flags, reference_greedy  # noqa: E402
from tiny_model import executor_dtype, kv_bytes  # noqa: E402

from launcher.processes import free_ports  # noqa: E402

pytestmark = pytest.mark.processes

PROMPT = [3 + (i * 7) % 90 for i in range(48)]             # 12 blocks of 4
OTHERS = [[50 + j + (i * 11) % 40 for i in range(48)] for j in range(8)]
HOST, DISK = 0, 1


def of_blocks(n: int) -> int:
    """Bytes of n blocks in the executors' dtype: the pool, the host tier and the disk are counted in blocks."""
    return kv_bytes(n, dtype=executor_dtype())


def run(fleet, prompt, tokens=8) -> list[int]:
    s = Streams(fleet.stub, [prompt], max_tokens=tokens)
    s.join()
    assert s.errors == [None]
    return s.tokens[0]


def tier(fleet):
    e = fleet.stats().executors[0]
    return list(e.kv_tier_blocks), list(e.kv_tier_hits), e.kv_tier_hit_tokens


def test_evicted_prefixes_come_back_from_host_and_disk_and_a_restarted_executor_comes_back_warm(tmp_path):
    disk = tmp_path / "kv-disk"
    metrics = free_ports(1)[0]
    flags = ("--kv-cache-memory", of_blocks(64), "--kv-host-memory", of_blocks(16), "--kv-disk-dir", disk,
             "--kv-disk-bytes", of_blocks(400),
             "--metrics-address", f"127.0.0.1:{metrics}", *deterministic_flags())
    fleet = Fleet(tmp_path, 1, executor_flags=flags)
    try:
        want = run(fleet, PROMPT)
        for other in OTHERS:                      # 8 x 14 blocks through a pool of 63: PROMPT's are evicted
            run(fleet, other)
        blocks, hits, _ = tier(fleet)
        assert blocks[HOST] == 16 and blocks[DISK] > 0 and hits == [0, 0]
        assert run(fleet, PROMPT) == want
        blocks, hits, hit_tokens = tier(fleet)
        assert sum(hits) == 11 and hit_tokens == 44, "every full block but the last token's, from the tiers"
        assert hits[DISK] > 0, "the oldest blocks had gone down to disk"
        # Loaded, not refused and recomputed: no step was refused, nothing was computed twice.
        assert fleet.stats().executors[0].num_recomputed_tokens == 0
        assert "refused" not in (tmp_path / "executor-0.log").read_text()
        scraped = httpx.get(f"http://127.0.0.1:{metrics}/metrics").text
        for name in [name for name, n in zip(("host", "disk"), hits, strict=True) if n]:
            n = float(hits[name == "disk"])
            assert f'stepwire:executor_kv_tier_loaded_blocks_total{{tier="{name}"}} {n}' in scraped
            assert f'stepwire:executor_kv_tier_bytes_total{{direction="in",tier="{name}"}} {n * of_blocks(1)}' \
                in scraped

        # Started again on the same directory: its disk blocks are announced, and the first request hits them.
        fleet.stack.kill("executor-0")
        fleet.start_executor(0)
        fleet.wait_connected(fleet.addresses)
        blocks, hits, _ = tier(fleet)
        assert blocks[HOST] == 0 and blocks[DISK] > 0 and hits == [0, 0]
        assert run(fleet, OTHERS[0]) == run_ref(fleet, OTHERS[0])
        _, hits, _ = tier(fleet)
        assert hits[DISK] == 11, "warm: the restarted executor's first request came from its disk"
        assert "refused" not in (tmp_path / "executor-0.log").read_text()

        # Damaged on disk: refused (the step is refused, the scheduler recomputes), the tokens unchanged.
        for f in disk.glob("*.kv"):
            raw = bytearray(f.read_bytes())
            raw[-7] ^= 0x5A
            f.write_bytes(bytes(raw))
        assert run(fleet, OTHERS[1]) == run_ref(fleet, OTHERS[1])
        log = (tmp_path / "executor-0.log").read_text()
        assert "KV tier block refused" in log and "digest mismatch" in log
    finally:
        fleet.stop()


REFS: dict = {}


def run_ref(fleet, prompt):
    """The prompt's tokens as a fresh fleet without tiers computes them (one per test session)."""
    key = tuple(prompt)
    if key not in REFS:
        REFS[key] = reference_greedy(fleet.model, [prompt], 8)[0]
    return REFS[key]


def test_one_executors_evicted_prefix_serves_another_executors_hit_through_the_shared_host_tier(tmp_path):
    """Two executors share a host tier (--kv-host-shared): the prompt's blocks that the first one's pool evicted
    are loaded by the second, once the first is killed, with the tokens the first computed."""
    shm = tmp_path / "shm"
    shm.mkdir()
    flags = ("--kv-cache-memory", of_blocks(40), "--kv-host-memory", of_blocks(300), "--kv-host-shared", "host0",
             "--kv-shared-memory-dir", shm, *deterministic_flags())
    fleet = Fleet(tmp_path, 2, executor_flags=flags, started=1)      # the second starts later
    try:
        want = run(fleet, PROMPT)
        for other in OTHERS:                      # 8 x 14 blocks through a pool of 39: PROMPT's are evicted
            run(fleet, other)
        assert fleet.stats().executors[0].kv_tier_blocks[HOST] > 0
        fleet.start_executor(1)
        fleet.wait_connected(fleet.addresses)
        stats = fleet.stats().executors
        assert stats[1].kv_tier_blocks[HOST] == stats[0].kv_tier_blocks[HOST], "one tier, one index"
        fleet.stack.kill("executor-0")
        fleet.wait_connected(fleet.addresses[1:])
        assert run(fleet, PROMPT) == want
        second = fleet.stats().executors[1]
        assert list(second.kv_tier_hits) == [11, 0] and second.kv_tier_hit_tokens == 44, \
            "every full block but the last token's, from what the killed executor wrote"
        assert second.num_recomputed_tokens == 0
        assert "refused" not in (tmp_path / "executor-1.log").read_text()
        assert len(list(shm.glob("stepwire-kvhost-host0"))) == 1
    finally:
        fleet.stop()
    assert not list(shm.glob("stepwire-kvhost-*")), "the last executor to stop removes the shared segment"
