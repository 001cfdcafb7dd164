"""Where the Step stream is (executor_service/step_progress.py): a pull's write holds the gate, so a new epoch
waits for it; the steps that run meanwhile are recorded at once, so Step replies never wait for a copy."""

import asyncio

from executor_service.step_progress import StepProgress


def test_steps_are_recorded_during_a_write_and_a_new_epoch_waits_for_it():
    async def main():
        p = StepProgress()
        await p.begin(7)
        order = []
        async with p.gate:                          # a pull's write under way
            await asyncio.wait_for(p.ran(7, 3), 1)  # a step's reply goes on
            assert p.step == 3
            newer = asyncio.ensure_future(p.begin(8))
            await asyncio.sleep(0.05)
            assert not newer.done() and p.generation == 1      # waits for the write
            order.append("write ended")
        await newer
        order.append("new epoch")
        assert (p.epoch, p.generation, order) == (8, 2, ["write ended", "new epoch"])

    asyncio.run(main())
