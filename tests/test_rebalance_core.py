"""The rebalancer's choices on a fleet of scheduler cores (no process, no step run): queued requests move to
where they start sooner by more than a pull's overhead, never onto a decode executor, and never back and forth;
running requests are chosen off the fuller pool, the longest still to generate first, one always left."""

from helpers import make_scheduler, place_running, req

from scheduler_service.fleet import rebalance
from scheduler_service.fleet.executor_link import ExecutorLink
from scheduler_service.fleet.fleet import Fleet
from scheduler_service.settings import SchedulerSettings
from scheduler_service.telemetry.lifecycle import Lifecycles
from scheduler_service.telemetry.metrics import SchedulerMetrics
from stepwire.contract.settings import load


def fleet_of(*roles: str, num_blocks: int = 256, flags=()) -> Fleet:
    settings = load(SchedulerSettings, ["--kv-pull-overhead-tokens", "64", *flags])
    fleet = Fleet(settings, Lifecycles(SchedulerMetrics(lambda: []), "m"))
    for i, role in enumerate(roles):
        link = ExecutorLink(f"127.0.0.1:{i + 1}", settings, lifecycles=fleet.lifecycles)
        link.core = make_scheduler(num_blocks, block_size=4, max_model_len=1024)
        link.connected, link.role, link.kv_layout = True, role, "L"
        fleet.links[link.address] = link
    return fleet


def queue(link, n: int, tokens: int, first: int = 0):
    for i in range(n):
        link.core.add_request(req(f"q{first + i}", tokens, first=first + 1000 * i))


def test_queued_requests_move_newest_first_until_the_queues_are_even():
    fleet = fleet_of("mixed", "mixed")
    busy, idle = fleet.links.values()
    queue(busy, 8, 200)
    moved = rebalance.move_queued(fleet, min_gain=64)
    assert moved > 0 and len(busy.core.waiting) + len(idle.core.waiting) == 8
    assert abs(len(busy.core.waiting) - len(idle.core.waiting)) <= 1
    assert {r.request_id for r in idle.core.waiting} <= {f"q{i}" for i in range(4, 8)}   # the newest ones
    assert rebalance.move_queued(fleet, min_gain=64) == 0                                 # and no way back
    assert fleet.num_rebalanced == moved


def test_a_small_gap_moves_nothing():
    fleet = fleet_of("mixed", "mixed")
    busy, _ = fleet.links.values()
    queue(busy, 1, 60)                 # 60 tokens of work ahead: less than the 64 a move must save
    assert rebalance.move_queued(fleet, min_gain=64) == 0


def test_a_prefill_executors_queue_never_moves_onto_a_decode_executor():
    fleet = fleet_of("prefill", "decode")
    prefill, decode = fleet.links.values()
    queue(prefill, 8, 200)
    assert rebalance.move_queued(fleet, min_gain=64) == 0
    assert len(prefill.core.waiting) == 8 and not decode.core.requests


def test_running_requests_leave_the_fuller_pool_longest_first_and_one_stays():
    fleet = fleet_of("mixed", "mixed", num_blocks=64, flags=["--rebalance-threshold", "0.25"])
    full, empty = fleet.links.values()
    for i, left in enumerate((4, 100, 50, 30)):          # tokens each still has to generate
        r = req(f"r{i}", 24, max_tokens=left + 4, first=100 * i)
        place_running(full.core, r, num_computed=27, num_output=4)
    assert full.core.kv.usage - empty.core.kv.usage >= 0.25
    exported = []
    full.start_export = lambda ids: exported.append(ids)
    assert rebalance.move_running(fleet, 0.25) > 0
    [ids] = exported
    assert "r1" in ids and "r0" not in ids and len(ids) < 4      # r0 ends in 4 tokens; r1 has the most left
    assert rebalance.move_running(fleet, 0.99) == 0            # a gap under the threshold moves nothing


def test_a_running_request_is_not_chosen_while_a_transfer_from_its_executor_runs():
    fleet = fleet_of("mixed", "mixed", num_blocks=64)
    full, _ = fleet.links.values()
    for i in range(4):
        place_running(full.core, req(f"r{i}", 24, max_tokens=100, first=100 * i), num_computed=27, num_output=4)
    fleet.kv_moves.in_transit["x"] = type("Move", (), {"source": full, "target": None})()
    assert rebalance.move_running(fleet, 0.1) == 0
