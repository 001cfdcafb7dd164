"""The router on scheduler cores alone: the longest prefix hit wins over load, load breaks ties, and
least-loaded routing ignores the hit."""

from helpers import make_scheduler, req, step

from scheduler_service.routing import pick


def _cores():
    return [make_scheduler(block_size=4, num_blocks=64, max_model_len=256) for _ in range(3)]


def test_a_request_goes_where_its_prefix_is_cached_even_if_that_executor_is_busier():
    cores = _cores()
    cores[2].add_request(req("warm", 16, max_tokens=1))
    step(cores[2])                                     # its blocks are now in core 2's pool
    for i in range(3):
        cores[2].add_request(req(f"busy{i}", 8, first=100 + 10 * i))
    i, hit = pick(req("new", 20), cores)               # same first 16 tokens as "warm"
    assert (i, hit) == (2, 16)


def test_without_a_hit_the_least_loaded_executor_wins_waiting_then_running():
    cores = _cores()
    cores[0].add_request(req("a", 8, first=100))
    cores[1].add_request(req("b", 8, first=200))
    step(cores[1])                                     # b runs on core 1; a still waits on core 0
    assert pick(req("new", 8, first=300), cores) == (2, 0)
    cores[2].add_request(req("c", 8, first=400))
    step(cores[2])
    cores[1].add_request(req("d", 8, first=500))
    step(cores[1])
    # Core 0: one waiting; core 1: two running; core 2: one running.
    assert [(len(c.waiting), len(c.running)) for c in cores] == [(1, 0), (0, 2), (0, 1)]
    assert pick(req("new2", 8, first=600), cores) == (2, 0)
    assert pick(req("new3", 8, first=700), []) == (-1, 0)


def test_least_loaded_routing_ignores_the_cached_prefix():
    cores = _cores()
    cores[0].add_request(req("warm", 16, max_tokens=1))
    step(cores[0])
    cores[0].add_request(req("busy", 8, first=100))
    assert pick(req("new", 20), cores)[0] == 0
    assert pick(req("new", 20), cores, by_prefix=False)[0] != 0
