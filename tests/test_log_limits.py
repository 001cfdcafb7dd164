"""Rate-limited log lines: the first always, then at most one per period, the held-back ones counted."""

from observability.log_limits import Every, held_note


def test_repeats_within_the_period_are_held_back_and_counted_in_the_next_line():
    now = [0.0]
    every = Every(10.0, clock=lambda: now[0])
    assert every.ready("resync") == 0             # the first one always
    assert every.ready("resync") is None
    assert every.ready("other") == 0              # each kind of line has its own period
    now[0] = 5.0
    assert every.ready("resync") is None
    now[0] = 10.5
    assert every.ready("resync") == 2             # two held back since the last line
    assert every.ready("resync") is None
    assert held_note(2) == " (2 more like it since the last such line)" and held_note(0) == ""
