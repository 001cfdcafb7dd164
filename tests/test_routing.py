"""The router on scheduler cores alone: the longest prefix hit wins over load, load breaks ties, least-loaded
routing ignores the hit, and a prefix pull to a less loaded executor happens only when it costs less (in
tokens) than computing the prefix there and than waiting for the busy one."""

from helpers import make_scheduler, req, step

from scheduler_service.fleet.routing import PullCost, pick, queued_tokens


def _cores(n: int = 3):
    return [make_scheduler(block_size=4, num_blocks=256, max_model_len=1024) for _ in range(n)]


def _warm(core, rid: str, n: int, first: int = 0):
    core.add_request(req(rid, n, max_tokens=1, first=first))
    while core.has_unfinished_requests():
        step(core)                                     # its blocks are now in the pool's prefix cache


def test_a_request_goes_where_its_prefix_is_cached_even_if_that_executor_is_busier():
    cores = _cores()
    _warm(cores[2], "warm", 16)
    for i in range(3):
        cores[2].add_request(req(f"busy{i}", 8, first=100 + 10 * i))
    choice = pick(req("new", 20), cores)               # same first 16 tokens as "warm"
    assert (choice.index, choice.hit, choice.source) == (2, 16, -1)
    choice = pick(req("new", 20), cores, pulls=PullCost(), layouts=["L"] * 3)
    assert (choice.index, choice.source) == (2, -1)     # 16 cached tokens are never worth a pull


def test_without_a_hit_the_least_loaded_executor_wins_waiting_then_running():
    cores = _cores()
    cores[0].add_request(req("a", 8, first=100))
    cores[1].add_request(req("b", 8, first=200))
    step(cores[1])                                     # b runs on core 1; a still waits on core 0
    assert pick(req("new", 8, first=300), cores).index == 2
    cores[2].add_request(req("c", 8, first=400))
    step(cores[2])
    cores[1].add_request(req("d", 8, first=500))
    step(cores[1])
    # Core 0: one waiting; core 1: two running; core 2: one running. Decodes are not queued prompt tokens.
    assert [(len(c.waiting), len(c.running)) for c in cores] == [(1, 0), (0, 2), (0, 1)]
    assert [queued_tokens(c) for c in cores] == [8, 0, 0]
    assert pick(req("new2", 8, first=600), cores).index == 2
    assert pick(req("new3", 8, first=700), []).index == -1


def test_least_loaded_routing_ignores_the_cached_prefix():
    cores = _cores()
    _warm(cores[0], "warm", 16)
    cores[0].add_request(req("busy", 8, first=100))
    assert pick(req("new", 20), cores).index == 0
    assert pick(req("new", 20), cores, by_prefix=False).index != 0


def test_a_long_prefix_on_a_busy_executor_is_pulled_to_an_idle_one():
    cores = _cores(2)
    _warm(cores[0], "warm", 512)
    for i in range(4):
        cores[0].add_request(req(f"busy{i}", 200, first=2000 + 300 * i))  # 800 tokens queued on core 0
    pulls = PullCost(overhead_tokens=64, token_cost=0.25)
    choice = pick(req("new", 520), cores, pulls=pulls, layouts=["L", "L"])
    # Core 0: 8 to compute + 800 queued; core 1 computing it all: 520; pulling 512 of them: 8 + 128 + 64.
    assert (choice.index, choice.hit, choice.source, choice.pulled) == (1, 0, 0, 512)
    assert choice.cost == 8 + 0.25 * 512 + 64


def test_no_pull_when_computing_the_prefix_costs_less_the_layouts_differ_or_the_queue_is_short():
    cores = _cores(2)
    _warm(cores[0], "warm", 64)
    _warm(cores[0], "warm2", 512, first=5000)
    big = req("new2", 520, first=5000)
    pulls = PullCost(64, 0.25)
    assert pick(big, cores, pulls=pulls, layouts=["L", "L"]).source == -1            # nothing queued on core 0
    for i in range(4):
        cores[0].add_request(req(f"busy{i}", 200, first=2000 + 300 * i))
    # 64 cached tokens: pulling costs 16 + 256 overhead, more than computing them (64). It waits on core 0.
    choice = pick(req("new", 72), cores, pulls=PullCost(256, 0.25), layouts=["L", "L"])
    assert (choice.index, choice.source) == (0, -1)
    assert pick(big, cores, pulls=pulls, layouts=["L", "M"]).source == -1
    assert pick(big, cores, pulls=pulls, layouts=["", ""]).source == -1
    assert pick(big, cores, pulls=PullCost(64, 1.0), layouts=["L", "L"]).source == -1   # a pull costs a compute
    assert pick(big, cores, pulls=pulls, layouts=["L", "L"]).source == 0


def test_the_executor_a_request_leaves_is_never_chosen_but_may_be_the_pull_source():
    cores = _cores(2)
    _warm(cores[0], "warm", 512)
    big = req("queued", 520)
    choice = pick(big, cores, pulls=PullCost(64, 0.25), layouts=["L", "L"], exclude=0)
    assert (choice.index, choice.source, choice.pulled) == (1, 0, 512)
    assert pick(big, cores, exclude=0).index == 1
    assert pick(big, cores[:1], exclude=0).index == -1


def test_a_prefix_on_an_executors_kv_tier_draws_the_request_there_but_less_than_one_in_its_pool():
    from scheduler_service.core.kv_cache.hashing import extend_block_hashes
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(0, 20)), 4)
    cores = _cores()
    cores[1].kv.configure_tiers(8, 8, [(1, s, h) for s, h in enumerate(hashes[:4])])      # 16 tokens on disk
    for i in range(2):
        cores[1].add_request(req(f"busy{i}", 8, first=100 + 10 * i))                     # and it is busier
    choice = pick(req("new", 20), cores)
    assert choice.index == 1 and choice.hit == 0         # the pool's hit is none: the tier's counts in the choice
    _warm(cores[2], "warm", 8)                           # 8 tokens in a pool lose to 16 on disk (12.8)
    assert pick(req("new", 20), cores).index == 1
    _warm(cores[0], "warm", 16)                          # 16 in a pool beat 16 on disk
    assert pick(req("new", 20), cores).index == 0
