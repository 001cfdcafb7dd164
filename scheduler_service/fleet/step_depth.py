"""How many steps an executor link keeps sent and unanswered (--max-steps-in-flight), chosen per executor.

The executor runs the steps in order; what is in flight beyond the step it runs is what hides the hop, the
scheduler's Python and the executor's decoding behind the forward pass (async scheduling). How many that takes
depends on the executor, so each link picks its own from its executor's Describe:
- 1 without async scheduling, and for a prefill executor: its requests leave after their first token, and a
  handoff waits until no step of theirs is in flight.
- 2 for an executor in lockstep: it answers step N as soon as N's tokens are back, and N+1 is already queued.
- 3 for one that runs ahead (executor_service/api/step_in_flight.py): it holds N's reply until N+1 is launched, so
  with two in flight the scheduler could send N+2 only after N+1's launch, and the executor, having nothing
  queued behind N+1, would wait for N+1's tokens before answering it: lockstep again, one hop later (on an
  H100 that made the split stack slower, docs/gpu.md). With three, N+2 is queued when N+1 launches.
"""

from __future__ import annotations


def steps_in_flight(setting: str | int, async_scheduling: bool, role: str, runs_ahead: bool) -> int:
    """The depth for one executor: `setting` (a number overrides, "auto" chooses) with what its Describe says
    (`role`, `runs_ahead`)."""
    if not async_scheduling or role == "prefill":
        return 1
    if setting != "auto":
        return int(setting)
    return 3 if runs_ahead else 2
