"""How the scheduler groups the requests that leave an executor into pulls (scheduler_service/kv_moves.py): one
pull per target for a drain's requests, never past MAX_PULL_BLOCKS and never with a source block twice; each move
gets its own share of the pull's bytes and time; and a target is told the source's cache file only where no step
of the source can still write the blocks."""

from types import SimpleNamespace

from scheduler_service.kv_moves import MAX_PULL_BLOCKS, KVMoves, _batch, _share
from stepwire.internal import executor_pb2


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
