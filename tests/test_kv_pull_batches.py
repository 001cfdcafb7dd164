"""How the scheduler groups the requests that leave an executor into pulls (scheduler_service/fleet/kv_moves.py): one
pull per target for a drain's requests, never past MAX_PULL_BLOCKS and never with a source block twice; each move
gets its own share of the pull's bytes and time; and a target is told the source's cache file only where no step
of the source can still write the blocks."""

import asyncio
from types import SimpleNamespace

import pytest
from helpers import req, step

from scheduler_service.fleet.kv_moves import MAX_PULL_BLOCKS, KVMoves, _batch, _share
from stepwire.contract.metadata import PULL_ENDED
from stepwire.internal import executor_pb2

CACHE = "stepwire-kv-" + "c" * 32


class Describes:
    async def Describe(self, request, timeout=None):
        return executor_pb2.DescribeResponse(num_blocks=64, block_size=4, max_model_len=256, model="m",
                                             kv_layout="same-layout", kv_cache_file=CACHE)


async def two_connected_executors():
    """A fleet of two fake executors whose caches are in shared memory, in-process (no step loop: the test drives
    the cores), as tests/test_kv_move_failures.py has them."""
    from scheduler_service.fleet.fleet import Fleet
    from scheduler_service.settings import SchedulerSettings
    from scheduler_service.telemetry.lifecycle import Lifecycles
    from scheduler_service.telemetry.metrics import SchedulerMetrics
    from stepwire.contract.settings import load
    fleet = Fleet(load(SchedulerSettings, ["--executor-wait-seconds", "30"]),
                  Lifecycles(SchedulerMetrics(lambda: []), "m"))
    links = [fleet.add(f"127.0.0.1:{port}") for port in (1, 2)]
    for link in links:
        link.task.cancel()
        await link._connect(Describes())
    return fleet, links


def part(name: str, src: list[int]):
    return (name, src, [b + 1000 for b in src])


def test_a_drains_requests_go_to_one_target_in_one_pull():
    batches = []
    for p in (part("r1", [1, 2, 3]), part("r2", [4, 5]), part("r3", [6])):
        _batch(batches, p)
    assert [[name for name, _, _ in b] for b in batches] == [["r1", "r2", "r3"]]


def test_a_pull_holds_at_most_max_pull_blocks_and_the_rest_go_in_another():
    half = MAX_PULL_BLOCKS // 2
    batches = []
    for i in range(3):
        _batch(batches, part(f"r{i}", list(range(1 + i * half, 1 + (i + 1) * half))))
    assert [[name for name, _, _ in b] for b in batches] == [["r0", "r1"], ["r2"]]
    assert all(sum(len(src) for _, src, _ in b) <= MAX_PULL_BLOCKS for b in batches)


def test_requests_that_share_cached_source_blocks_go_in_separate_pulls():
    """A source admits a read of each block once: the shared prefix would be refused as a block asked twice."""
    batches = []
    for p in (part("r1", [1, 2, 3]), part("r2", [1, 2, 7]), part("r3", [8])):
        _batch(batches, p)
    assert [[name for name, _, _ in b] for b in batches] == [["r1"], ["r2", "r3"]]


def test_each_move_gets_its_share_of_the_pulls_bytes_and_time():
    reply = executor_pb2.PullBlocksResponse(bytes=10 * 4096, seconds=0.02, transport="shared_memory")
    a, b = _share(reply, 7, 10), _share(reply, 3, 10)
    assert (a.bytes, b.bytes) == (7 * 4096, 3 * 4096)
    assert abs(a.seconds + b.seconds - 0.02) < 1e-12 and a.transport == b.transport == "shared_memory"
    assert _share(None, 3, 10) is None                    # a failed pull: every move failed


def test_the_target_is_told_the_sources_cache_only_where_its_blocks_are_final():
    cache = executor_pb2.CacheFile(name="stepwire-kv-" + "a" * 32, num_blocks=100)
    source = SimpleNamespace(kv_cache=cache, epoch=5)
    move = lambda kind, epoch=5: SimpleNamespace(kind=kind, source=source, source_epoch=epoch)  # noqa: E731
    for kind in ("leave", "handoff", "rebalance"):            # sent once every step sent to the source had run
        assert KVMoves._final_cache(move(kind)) == cache
    assert KVMoves._final_cache(move("prefix")) is None       # a step in flight may still fill its blocks
    assert KVMoves._final_cache(move("leave", epoch=4)) is None      # the source restarted: another file now


class Target:
    """A target executor's PullBlocks: records each pull, and answers it or fails it (saying it stopped)."""

    def __init__(self, fail: bool):
        self.fail, self.pulls = fail, []

    async def PullBlocks(self, request, timeout=None):
        import grpc
        self.pulls.append(request)
        if self.fail:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DATA_LOSS, grpc.aio.Metadata(),
                                       grpc.aio.Metadata((PULL_ENDED, "1")), "checksum does not match")
        return executor_pb2.PullBlocksResponse(bytes=len(request.target_blocks) * 4096, seconds=0.01,
                                               transport="shared_memory")


@pytest.mark.parametrize("fail", [False, True])
def test_a_drain_of_two_requests_is_one_pull_and_each_request_ends_on_its_own_with_no_block_left_held(fail):
    """Done: both resume on the target with their KV, the source holds no pin, each counted with its share.
    Failed: both go back through routing from their tokens, and neither side keeps a block."""
    async def run():
        fleet, (source, target) = await two_connected_executors()
        rs = [req(f"r{i}", 22, max_tokens=20, first=100 * i, ignore_eos=True) for i in range(2)]
        for r in rs:
            source.core.add_request(r)
        for _ in range(4):
            step(source.core)
        free = target.core.kv.num_free_blocks
        target.stub = Target(fail)
        fleet.kv_moves.export_running(source, frozenset({"r0", "r1"}))
        await asyncio.gather(*fleet.kv_moves._tasks)
        return fleet, source, target, free

    fleet, source, target, free = asyncio.run(run())
    [pull] = target.stub.pulls                                    # one pull for both
    assert len(pull.source_blocks) == len(pull.target_blocks) == 14 and len(set(pull.source_blocks)) == 14
    assert pull.source_cache.name == CACHE                        # their blocks are final: copy at once
    assert not fleet.kv_moves.in_transit and all(source.core.kv.pinned(f"r{i}") is None for i in range(2))
    counts = fleet.kv_moves.counts
    if fail:
        assert counts.failures == 2 and counts.transfers == 0
        assert target.core.kv.num_free_blocks == free and target.core.kv.reserved("r0") is None
    else:
        assert counts.transfers == 2 and counts.bytes == 14 * 4096 and counts.tokens == 2 * 25
        assert {"r0", "r1"} <= set(target.core.requests)
