"""The executor fleet as real processes on loopback: executors die, drain and get hostile messages under load,
and no request is lost, duplicated or left hanging."""

import socket
import time

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")

from fake_discovery import FakeDNS, FakeKubeAPI  # noqa: E402
from fleet_stack import BUDGET, PROMPTS, TOKENS, Fleet, Streams, deterministic_flags, reference_greedy  # noqa: E402
from helpers import free_ports, wait_until  # noqa: E402

from stepwire.internal import executor_pb2, executor_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`

# Every answer is compared token for token with the in-process engine's (reference_greedy, in the same mode):
# in bfloat16 the executors run in deterministic mode, or a request recomputed elsewhere could round otherwise.
EXACT = deterministic_flags()


@pytest.fixture
def two(tmp_path):
    fleet = Fleet(tmp_path, 2, "--executor-wait-seconds", "20", "--drain-seconds", "5",
                  executor_flags=("--drain-seconds", "15", *EXACT))
    yield fleet
    fleet.stop()


def _no_fault(fleet, prompts, **params):
    s = Streams(fleet.stub, prompts, **params)
    s.join()
    assert s.errors == [None] * len(prompts)
    return s.tokens


def _kill_a_busy_executor_mid_stream(fleet, seeded: dict) -> tuple[Streams, Streams, str]:
    """16 greedy and 8 seeded streams; an executor running some of them killed once every stream has its first
    token. Returns them ended, every one without an error, and the killed executor's address."""
    greedy, sampled = Streams(fleet.stub, PROMPTS), Streams(fleet.stub, PROMPTS[:8], **seeded)
    wait_until(lambda: greedy.started() and sampled.started(), 30, "every stream's first token", interval=0.005)
    killed = fleet.busy()
    fleet.stack.kill(killed)
    greedy.join()
    sampled.join()
    assert greedy.errors == [None] * 16 and sampled.errors == [None] * 8
    return greedy, sampled, fleet.stack[killed].address


def test_killing_one_of_two_executors_mid_stream_loses_and_repeats_no_token(two):
    expected = reference_greedy(two.model, PROMPTS, max_tokens=TOKENS, budget=BUDGET)
    seeded = {"temperature": 1.0, "seed": list(range(100, 108))}
    expected_seeded = _no_fault(two, PROMPTS[:8], **seeded)
    greedy, sampled, killed = _kill_a_busy_executor_mid_stream(two, seeded)
    # Every stream is the whole answer, once: nothing repeated after the move, nothing skipped.
    assert greedy.tokens == expected
    assert sampled.tokens == expected_seeded
    stats = two.stats()
    (lost,) = [e for e in stats.executors if e.address == killed]
    assert stats.num_migrations > 0 and lost.num_migrated_out == stats.num_migrations
    assert not lost.connected and stats.num_requests == 0


def test_in_bfloat16_deterministic_mode_a_killed_executor_changes_no_token(tmp_path):
    """Requests moved off a dead executor are recomputed beside other neighbours, in other chunks, and here
    on an executor of another tensor-parallel degree (two ranks, then one): in bfloat16 deterministic mode
    every stream still equals the run without a fault."""
    fleet = Fleet(tmp_path, 2, "--executor-wait-seconds", "20",
                  executor_flags=("--deterministic", "--dtype", "bfloat16"),
                  flags_of={0: ("--tensor-parallel-size", "2")})
    try:
        seeded = {"temperature": 1.0, "seed": list(range(100, 108))}
        expected, expected_seeded = _no_fault(fleet, PROMPTS), _no_fault(fleet, PROMPTS[:8], **seeded)
        greedy, sampled, _ = _kill_a_busy_executor_mid_stream(fleet, seeded)
        assert greedy.tokens == expected and sampled.tokens == expected_seeded
        assert fleet.stats().num_migrations > 0
    finally:
        fleet.stop()


def test_an_executor_that_stops_answering_is_found_by_keepalive_and_its_requests_move(tmp_path):
    # A frozen process keeps its connections open: only the keepalive pings going unanswered tell.
    fleet = Fleet(tmp_path, 2, "--keepalive-seconds", "1", "--executor-wait-seconds", "20", executor_flags=EXACT)
    try:
        expected = reference_greedy(fleet.model, PROMPTS, max_tokens=TOKENS, budget=BUDGET)
        streams = Streams(fleet.stub, PROMPTS)
        wait_until(streams.started, 30, "every stream's first token", interval=0.005)
        frozen = fleet.busy()
        fleet.stack.pause(frozen)
        streams.join()
        assert streams.errors == [None] * 16 and streams.tokens == expected
        (lost,) = [e for e in fleet.stats().executors if e.address == fleet.stack[frozen].address]
        assert not lost.connected and lost.num_migrated_out > 0
    finally:
        for name in ("executor-0", "executor-1"):
            fleet.stack.resume(name)
        fleet.stop()


def test_a_listed_executor_that_starts_under_load_takes_requests_without_a_restart(tmp_path):
    # Static membership: the second listed executor is down when the scheduler starts and comes up under load.
    fleet = Fleet(tmp_path, 2, "--executor-wait-seconds", "20", started=1, executor_flags=EXACT)
    try:
        _joins_under_load_then_one_leaves(fleet, add=lambda: None)
    finally:
        fleet.stop()


def test_sigterm_drains_an_executor_under_load_and_no_client_sees_an_error(two):
    expected = reference_greedy(two.model, PROMPTS, max_tokens=TOKENS, budget=BUDGET)
    streams = Streams(two.stub, PROMPTS)
    wait_until(streams.started, 30, "every stream's first token", interval=0.005)
    # While it drains, the executor opens nothing new: Describe (and so a new Step stream) is refused. The channel
    # is connected before the SIGTERM: under a loaded machine's scheduling, connecting after it could take longer
    # than a drain whose requests all move at once, and meet a server already closed instead of a draining one.
    refused = None
    with grpc.insecure_channel(two.addresses[0]) as channel:
        describe = executor_pb2_grpc.ExecutorStub(channel).Describe
        describe(executor_pb2.DescribeRequest(), timeout=5)
        t0 = time.monotonic()
        two.stack.terminate("executor-0")
        while refused is None and two.stack.alive("executor-0"):
            try:
                describe(executor_pb2.DescribeRequest(), timeout=1)
            except grpc.RpcError as e:
                refused = e
            time.sleep(0.02)
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in refused.details()
    assert two.stack.wait("executor-0", 20) == 0
    assert time.monotonic() - t0 < 15          # within its drain period
    streams.join()
    assert streams.errors == [None] * 16 and streams.tokens == expected
    log = (two.tmp / "executor-0.log").read_text()
    assert "drained: the scheduler closed its stream" in log
    # Nothing new goes to a drained executor: the next requests all run on executor-1.
    assert _no_fault(two, PROMPTS[:4]) == expected[:4]


def test_with_no_executor_left_open_and_new_requests_end_unavailable_within_the_deadline(tmp_path):
    fleet = Fleet(tmp_path, 1, "--executor-wait-seconds", "2")
    try:
        streams = Streams(fleet.stub, PROMPTS[:8])
        wait_until(streams.started, 30, "every stream's first token", interval=0.005)
        fleet.stack.kill("executor-0")
        killed = time.monotonic()
        late = Streams(fleet.stub, PROMPTS[8:10])
        streams.join(10)
        late.join(10)
        for s in (streams, late):
            assert all(e is not None and e.code() == grpc.StatusCode.UNAVAILABLE for e in s.errors), s.errors
            assert all(t - killed < 2 + 1 + 1 for t in s.ended_at)     # the deadline, a second, and the hop
        assert "no executor could take the request within 2s" in streams.errors[0].details()
        # Tokens delivered before the fault were real, and none came after it.
        assert all(0 < len(t) < TOKENS for t in streams.tokens)
    finally:
        fleet.stop()


def test_hostile_messages_on_an_executor_port_leave_the_fleet_serving(two):
    address = two.addresses[0]
    # A Step stream from a stranger, with the largest epoch and handles nobody assigned.
    stranger = grpc.insecure_channel(address)
    hostile = executor_pb2.StepRequest(epoch=2**64 - 1, step=7, handles=[4000000000], num_tokens=[5])
    try:
        replies = list(executor_pb2_grpc.ExecutorStub(stranger).Step(iter([hostile, hostile]), timeout=10))
        assert all(r.HasField("resync") for r in replies)
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)
    # Bytes that are not a StepRequest, and bytes that are not HTTP/2 at all.
    garbage = stranger.unary_unary("/stepwire.internal.Executor/Describe")
    with pytest.raises(grpc.RpcError):
        garbage(b"\xff\xff\xff\xff\x0f", timeout=5)
    with socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"\x00" * 64 + b"GET / HTTP/1.1\r\n\r\n")
    stranger.close()
    # The scheduler's own stream took the executor back; both serve, and the answers are right.
    assert _no_fault(two, PROMPTS) == reference_greedy(two.model, PROMPTS, max_tokens=TOKENS, budget=BUDGET)
    two.stack.check_alive()
    stats = two.stats().executors
    assert all(e.num_steps > 0 for e in stats)                  # both executors ran some of the requests
    wait_until(lambda: all(e.num_free_blocks == e.num_total_blocks for e in two.stats().executors), 10,
               "every block to come back")


def _joins_under_load_then_one_leaves(fleet, add, remove=None):
    """Load on executor-0; executor-1 appears (`add`) and takes the next requests; then executor-0 leaves the
    membership (`remove`) under load: its running requests finish there, nothing new goes there, its link
    ends, and the process is left alone. Every answer equals the reference."""
    prompts = PROMPTS[:8]
    expected = reference_greedy(fleet.model, prompts, max_tokens=TOKENS, budget=BUDGET)
    first = Streams(fleet.stub, prompts)
    wait_until(first.started, 30, "every stream's first token", interval=0.005)
    fleet.start_executor(1)
    add()
    fleet.wait_connected(fleet.addresses)
    second = Streams(fleet.stub, prompts)
    wait_until(second.started, 30, "the second wave's first tokens", interval=0.005)
    assert fleet.steps()[fleet.addresses[1]] > 0        # the newcomer took requests, with no restart
    assert {e.address: e.num_routed for e in fleet.stats().executors}[fleet.addresses[1]] > 0
    if remove is not None:
        remove()
        wait_until(lambda: fleet.addresses[0] not in fleet.steps(), 30, "executor-0 to leave the fleet")
    third = Streams(fleet.stub, prompts[:4])
    for s in (first, second, third):
        s.join()
        assert s.errors == [None] * len(s.errors)
    assert first.tokens == second.tokens == expected and third.tokens == expected[:4]
    if remove is not None:
        assert fleet.addresses[0] not in fleet.steps()
        assert fleet.stack.alive("executor-0")   # it left the membership; nobody killed it


def test_kubernetes_endpoint_slices_add_and_drain_executors_under_load(tmp_path):
    kube = FakeKubeAPI()
    fleet = None
    try:
        # Scheduler first, executors from the slices: the list it starts from names two of them.
        up = lambda i: {"ip": f"127.0.0.{i + 1}", "ready": True, "serving": True, "terminating": False}
        port = free_ports(1)[0]
        kube.put("exec-a", port, [up(0)])
        kube.put("exec-b", port, [])
        fleet = Fleet(tmp_path, 2, discovery=("--discovery", "kubernetes", "--kubeconfig", str(kube.kubeconfig(
            tmp_path)), "--kubernetes-namespace", "ns", "--kubernetes-watch-seconds", "5"), started=1,
            same_port=True, port=port, executor_flags=EXACT)

        def add():
            kube.expire()                  # the watch ends with 410 Gone: the scheduler lists again
            kube.put("exec-b", port, [up(1)])

        terminating = {"ip": "127.0.0.1", "ready": False, "serving": True, "terminating": True}
        _joins_under_load_then_one_leaves(fleet, add, lambda: kube.put("exec-a", port, [terminating]))
        assert kube.lists() >= 2
    finally:
        if fleet is not None:
            fleet.stop()
        kube.stop()


def test_dns_discovery_adds_and_drains_executors_under_load(tmp_path):
    dns = FakeDNS()
    fleet = None
    try:
        dns.records["executors.test"] = ["127.0.0.1"]
        port = free_ports(1)[0]
        fleet = Fleet(tmp_path, 2, discovery=("--discovery", "dns", "--executors", f"executors.test:{port}",
                                              "--dns-nameserver", dns.address, "--dns-refresh-seconds", "0.2"),
                      started=1, same_port=True, port=port, executor_flags=EXACT)
        _joins_under_load_then_one_leaves(
            fleet, lambda: dns.records["executors.test"].append("127.0.0.2"),
            lambda: dns.records.__setitem__("executors.test", ["127.0.0.2"]))
    finally:
        if fleet is not None:
            fleet.stop()
        dns.stop()


def test_an_executor_with_fewer_batch_rows_than_the_scheduler_allows_gets_no_more_at_once(tmp_path):
    # The scheduler allows 8 running requests per executor; this executor's batch holds 2. Describe says
    # so, and the scheduler keeps to it (it used to send 8 and have every step refused for ever).
    fleet = Fleet(tmp_path, 1, flags_of={0: ("--max-num-seqs", "2")}, executor_flags=EXACT)
    try:
        expected = reference_greedy(fleet.model, PROMPTS[:6], max_tokens=TOKENS, budget=BUDGET)
        streams = Streams(fleet.stub, PROMPTS[:6])
        most = 0
        while any(t.is_alive() for t in streams.threads):
            most = max(most, fleet.stats().executors[0].num_running)
            time.sleep(0.02)
        streams.join()
        assert streams.errors == [None] * 6 and streams.tokens == expected
        assert most == 2
    finally:
        fleet.stop()
