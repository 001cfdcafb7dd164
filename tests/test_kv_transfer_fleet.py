"""Requests that leave a draining executor with their KV, on real processes (a scheduler and tiny-model executors):
nothing is recomputed and the tokens are those of a run without a fault; a transfer that stalls, or whose
target or source dies under it, ends in a recompute with the same tokens and no block held anywhere."""

import grpc
import httpx
import pytest
from fleet_stack import TOKENS, Streams
from tcp_proxy import Proxy
from test_kv_transfer_executor import PROMPT
from tiny_model import executor_dtype, kv_bytes, write_tiny_llama
from tiny_model import reference_greedy as tiny_reference

from launcher.processes import Service, Stack, free_ports
from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.processes

BUDGET = 32
# Eight streams of 25 + 60 tokens: a few blocks each, well inside both pools, so nothing is preempted and every
# recomputed token is one a move cost.
PROMPTS = [[(t + i) % 90 + 3 for t in PROMPT] for i in range(8)]
# The executors' dtype: the one the environment chooses (conftest's float32, or a run's forced bfloat16), else
# their default on this machine.
DTYPE = executor_dtype()
# The tests here compare every token with a reference run, after moves and after recomputes in batches of other
# shapes. In bfloat16 (or float16) a batch's shape can change a logit's last bit and flip one of the tiny random
# model's many near-ties, so there the executors and the reference run batch-invariant kernels: the same bits in
# any batch, and still half-precision KV that moves. float32's default kernels are close enough as they are.
DETERMINISTIC = DTYPE != "float32"


def block_bytes() -> int:
    """One KV block of the tiny model (4 tokens, K and V, every layer) in the executors' dtype."""
    return kv_bytes(1, dtype=DTYPE)


def kv_memory(num_blocks: int) -> int:
    """KV-cache memory that holds `num_blocks` blocks in the executors' dtype: the same pools, and so the same
    usage to rebalance by, whatever the dtype."""
    return kv_bytes(num_blocks, dtype=DTYPE)


def reference_greedy(model, prompts: list[list[int]], max_tokens: int, budget: int = BUDGET) -> list[list[int]]:
    """Greedy tokens from the in-process engine configured as the executors here: deterministic where they are,
    and on one torch thread as they run (--threads 1)."""
    return tiny_reference(model, prompts, max_tokens, budget, one_thread=True, kv_cache_memory=kv_memory(64),
                          deterministic=DETERMINISTIC)


class KVFleet:
    """`n` executors and a scheduler; with `proxied`, the scheduler and every peer reach executor-0 through a
    proxy whose new connections a test can stall."""

    def __init__(self, tmp, n: int, *scheduler_flags, proxied: bool = False, executor_flags: dict | None = None):
        self.model = write_tiny_llama(tmp / "llama")
        ports = free_ports(n)
        self.proxy = Proxy(ports[0]) if proxied else None
        self.names = [f"executor-{i}" for i in range(n)]
        executors = [Service("executor", name, {
            "--model": self.model, "--address": f"127.0.0.1:{port}", "--block-size": 4,
            "--kv-cache-memory": kv_memory(256), "--max-num-seqs": 8, "--max-model-len": 128, "--metrics-address": "",
            "--threads": 1, "--drain-seconds": 30, "--deterministic": DETERMINISTIC,
            **(executor_flags or {}).get(name, {})})
            for name, port in zip(self.names, ports, strict=True)]
        listed = [f"127.0.0.1:{p}" for p in ports]
        if self.proxy:
            listed[0] = self.proxy.address
        self.listed = listed
        scheduler = Service("scheduler", flags={"--executors": ",".join(listed), "--max-num-batched-tokens": BUDGET,
                                                "--max-num-seqs": 8, "--metrics-address": "", "--retry-seconds": 0.2,
                                                "--drain-seconds": 30, **dict(zip(scheduler_flags[::2],
                                                                                  scheduler_flags[1::2], strict=True))})
        self.stack = Stack([*executors, scheduler], tmp)
        self.channel = grpc.insecure_channel(scheduler.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.stack.wait_until(lambda: sum(e.connected for e in self.stats().executors) == n, "every executor", 60)
        assert all(e.num_total_blocks == 256 - 1 for e in self.stats().executors)   # less the null block

    def stats(self) -> scheduler_pb2.StatsResponse:
        return self.stub.Stats(scheduler_pb2.StatsRequest(), timeout=5)

    def settled(self) -> bool:
        """No request anywhere, and every block of every connected executor back in its pool."""
        s = self.stats()
        return s.num_requests == 0 and all(e.num_free_blocks == e.num_total_blocks for e in s.executors
                                           if e.connected)

    def close(self):
        self.channel.close()
        if self.proxy:
            self.proxy.close()
        self.stack.close(check=False)


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("ref") / "llama")
    return reference_greedy(model, PROMPTS, max_tokens=TOKENS, budget=BUDGET)


def drain_first_executor_under_load(fleet: KVFleet, before_sigterm=lambda: None) -> Streams:
    streams = Streams(fleet.stub, PROMPTS)
    # Polled often: the tiny model makes a stream's 60 tokens in well under a second, and the drain must find
    # them running.
    fleet.stack.wait_until(lambda: all(len(t) >= 5 for t in streams.tokens), "five tokens on every stream", 60,
                           interval=0.005)
    before_sigterm()
    # Frozen while the signal is sent: otherwise its requests could finish in the moment between the check above and
    # the executor handling SIGTERM (the tiny model makes a token every few ms; on a loaded machine that moment
    # once took all 55 left), and the drain would find nothing to drain.
    fleet.stack.pause("executor-0")
    fleet.stack.terminate("executor-0")
    fleet.stack.resume("executor-0")
    return streams


@pytest.mark.parametrize("kv_transfer", [True, False], ids=["with KV", "recompute"])
def test_a_drained_executors_requests_leave_with_their_kv_and_nothing_is_recomputed(tmp_path, expected,
                                                                                   kv_transfer):
    metrics = free_ports(1)[0]
    fleet = KVFleet(tmp_path, 2, "--metrics-address", f"127.0.0.1:{metrics}",
                    *([] if kv_transfer else ["--no-kv-transfer", True]))
    try:
        streams = drain_first_executor_under_load(fleet)
        assert fleet.stack.wait("executor-0", 30) == 0
        streams.join()
        assert streams.errors == [None] * len(PROMPTS) and streams.tokens == expected
        fleet.stack.wait_until(fleet.settled, "every request ended and every block freed", 30)
        s = fleet.stats()
        recomputed = sum(e.num_recomputed_tokens for e in s.executors)
        if kv_transfer:
            assert s.num_kv_transfers > 0 and s.num_kv_transfer_failures == 0 and recomputed == 0
            assert s.recompute_avoided_tokens >= s.num_kv_transfers * len(PROMPT)
            assert s.kv_transfer_blocks >= s.num_kv_transfers * len(PROMPT) // 4
            assert s.kv_transfer_bytes == s.kv_transfer_blocks * block_bytes()     # blocks of the dtype they run
            assert 0 < s.kv_transfer_busy_seconds and 0 < s.kv_transfer_seconds
            assert all(e.kv_layout.startswith(f"llama:LlamaForCausalLM:{DTYPE}:") for e in s.executors if e.connected)
            scraped = httpx.get(f"http://127.0.0.1:{metrics}/metrics").text
            assert f'stepwire:kv_transfers_total{{outcome="done"}} {float(s.num_kv_transfers)}' in scraped
            assert f"stepwire:recompute_avoided_tokens_total {float(s.recompute_avoided_tokens)}" in scraped
        else:
            # The same drain without KV: whatever had not finished on executor-0 within the period is recomputed.
            assert s.num_kv_transfers == 0
        log = (tmp_path / "executor-0.log").read_text()
        assert "drained: the scheduler closed its stream" in log
    finally:
        fleet.close()


@pytest.mark.parametrize("fault", ["stall", "target killed", "source killed"])
def test_a_transfer_that_stalls_or_loses_a_side_ends_in_a_recompute_with_the_same_tokens(tmp_path, expected, fault):
    fleet = KVFleet(tmp_path, 3, "--kv-transfer-seconds", 3, "--keepalive-seconds", 2, proxied=True)
    try:
        # Every connection to executor-0 opened from now on hangs: the peers' reads of its blocks, not the
        # scheduler's step stream, which is already open.
        streams = drain_first_executor_under_load(fleet, before_sigterm=lambda: setattr(fleet.proxy, "stall_new",
                                                                                        True))
        fleet.stack.wait_until(lambda: fleet.proxy.stalled > 0, "a peer's pull to reach executor-0", 30)
        if fault == "target killed":
            fleet.stack.kill("executor-1")
        elif fault == "source killed":
            fleet.stack.kill("executor-0")
        streams.join(90)
        assert streams.errors == [None] * len(PROMPTS) and streams.tokens == expected
        s = fleet.stats()
        assert s.num_kv_transfer_failures > 0
        assert sum(e.num_recomputed_tokens for e in s.executors) > 0
        fleet.stack.wait_until(fleet.settled, "every request ended and every block freed", 30)
        if fault == "stall":
            # Its requests gone, the source's pins released: it ends its drain and exits on its own.
            assert fleet.stack.wait("executor-0", 30) == 0
    finally:
        fleet.close()
