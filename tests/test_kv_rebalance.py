"""Rebalancing and prefix pulls on real processes (a scheduler and tiny-model executors): running requests move
with their KV off a much fuller pool, and a request routed away from a busy executor pulls the prefix cached
there; either way nothing is recomputed and the tokens are those of a run without a move. A pull whose source
stalls or dies ends in a recompute with the same tokens and no block held anywhere."""

import httpx
import pytest
from fleet_stack import Streams
from test_kv_transfer_fleet import BUDGET, KVFleet, reference_greedy
from tiny_model import write_tiny_llama

from launcher.processes import free_ports

pytestmark = pytest.mark.processes

SHARED = [(7 * k) % 90 + 3 for k in range(20)]                # 5 blocks every prompt below starts with
RUNNING = [SHARED + [(11 * i + k) % 90 + 3 for k in range(5)] for i in range(8)]
LONG_TOKENS = 100                                            # 25 + 100 tokens: inside the 128-token context
PREFIX = [(5 * k + 1) % 90 + 3 for k in range(64)]           # 16 blocks: worth a pull at 16 tokens' overhead
PULLED = [PREFIX + [(13 * i + k) % 90 + 3 for k in range(32)] for i in range(8)]   # 32 tokens each to compute
PULL_TOKENS = 20


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("ref") / "llama")
    return {"running": reference_greedy(model, RUNNING, max_tokens=LONG_TOKENS, budget=BUDGET),
            "pulled": reference_greedy(model, PULLED, max_tokens=PULL_TOKENS, budget=BUDGET)}


def warm(fleet: KVFleet, prompt: list[int]) -> str:
    """Run `prompt` to its end, so that its blocks are cached; returns the executor it ran on."""
    Streams(fleet.stub, [prompt], max_tokens=1).join()
    fleet.stack.wait_until(lambda: fleet.stats().num_requests == 0, "the warm-up request to end", 30)
    [address] = [e.address for e in fleet.stats().executors if e.num_routed]
    return address


def test_running_requests_move_with_their_kv_off_a_much_fuller_pool(tmp_path, expected):
    metrics = free_ports(1)[0]
    # No pulls here: every request queues where the shared prefix is cached, and only the rebalancer moves them.
    fleet = KVFleet(tmp_path, 2, "--rebalance-seconds", 0.01, "--rebalance-threshold", 0.1,
                    "--kv-pull-token-cost", 1, "--metrics-address", f"127.0.0.1:{metrics}")
    try:
        warm(fleet, SHARED + [3])
        streams = Streams(fleet.stub, RUNNING, max_tokens=LONG_TOKENS)
        streams.join(120)
        assert streams.errors == [None] * len(RUNNING) and streams.tokens == expected["running"]
        fleet.stack.wait_until(fleet.settled, "every request ended and every block freed", 30)
        s = fleet.stats()
        assert s.num_rebalanced > 0 and s.num_kv_transfers > 0 and s.num_kv_transfer_failures == 0
        assert all(e.num_routed > 0 for e in s.executors)        # the idle one got requests only by moves
        assert sum(e.num_recomputed_tokens for e in s.executors) == 0
        assert s.num_migrations == 0 and s.num_prefix_pulls == 0
        scraped = httpx.get(f"http://127.0.0.1:{metrics}/metrics").text
        assert 'stepwire:rebalanced_requests_total{kind="running"}' in scraped
    finally:
        fleet.close()


def test_a_request_routed_away_from_a_busy_executor_pulls_the_prefix_cached_there(tmp_path, expected):
    # executor-0 runs two requests at a time, so a queue builds there behind the prefix it caches.
    fleet = KVFleet(tmp_path, 2, "--kv-pull-overhead-tokens", 16, "--rebalance-seconds", 0,
                    executor_flags={"executor-0": {"--max-num-seqs": 2}})
    try:
        source = warm(fleet, PREFIX + [3])
        assert source == fleet.listed[0]
        streams = Streams(fleet.stub, PULLED, max_tokens=PULL_TOKENS)
        streams.join(120)
        assert streams.errors == [None] * len(PULLED) and streams.tokens == expected["pulled"]
        fleet.stack.wait_until(fleet.settled, "every request ended and every block freed", 30)
        s = fleet.stats()
        assert s.num_prefix_pulls > 0 and s.num_kv_transfer_failures == 0
        assert s.recompute_avoided_tokens >= s.num_prefix_pulls * 16
        assert sum(e.num_recomputed_tokens for e in s.executors) == 0
        [target] = [e for e in s.executors if e.address != source]
        assert target.num_routed > 0
    finally:
        fleet.close()


@pytest.mark.parametrize("fault", ["stall", "source killed"])
def test_a_prefix_pull_whose_source_stalls_or_dies_ends_in_a_recompute_with_the_same_tokens(tmp_path, expected,
                                                                                          fault):
    fleet = KVFleet(tmp_path, 2, "--kv-pull-overhead-tokens", 16, "--rebalance-seconds", 0,
                    "--kv-transfer-seconds", 3, "--keepalive-seconds", 2, proxied=True,
                    executor_flags={"executor-0": {"--max-num-seqs": 2}})
    try:
        assert warm(fleet, PREFIX + [3]) == fleet.listed[0]
        fleet.proxy.stall_new = True      # executor-1's reads of executor-0's blocks hang; the step stream runs on
        streams = Streams(fleet.stub, PULLED, max_tokens=PULL_TOKENS)
        fleet.stack.wait_until(lambda: fleet.proxy.stalled > 0, "a pull to reach executor-0", 30)
        if fault == "source killed":
            fleet.stack.kill("executor-0")
        streams.join(90)
        assert streams.errors == [None] * len(PULLED) and streams.tokens == expected["pulled"]
        s = fleet.stats()
        assert s.num_kv_transfer_failures > 0
        fleet.stack.wait_until(fleet.settled, "every request ended and every block freed", 30)
    finally:
        fleet.close()
