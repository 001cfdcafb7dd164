"""Where the Step stream is (executor_service/kv/step_progress.py): a pull's write passes the gate, so a new epoch
waits for it; the steps that run meanwhile are recorded at once, so Step replies never wait for a copy; writes
pass together, and none starts while a new epoch waits."""

import asyncio

from executor_service.kv.step_progress import StepProgress


def test_steps_are_recorded_during_a_write_and_a_new_epoch_waits_for_it():
    async def main():
        p = StepProgress()
        await p.begin(7)
        order = []
        async with p.gate.write():                  # a pull's write under way
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


def test_writes_pass_the_gate_together_and_none_starts_while_a_new_epoch_waits():
    """Two pulls queue their copies on the engine side by side; a third that comes after a new epoch began
    waiting writes only once that epoch began (and then sees its generation changed)."""
    async def main():
        p = StepProgress()
        await p.begin(7)
        first, second = p.gate.write(), p.gate.write()
        await asyncio.wait_for(first.__aenter__(), 1)
        await asyncio.wait_for(second.__aenter__(), 1)          # not held up by the first
        newer = asyncio.ensure_future(p.begin(8))
        await asyncio.sleep(0.02)
        late_entered = asyncio.Event()

        async def late():
            async with p.gate.write():
                late_entered.set()
                return p.generation

        third = asyncio.ensure_future(late())
        await asyncio.sleep(0.02)
        assert not newer.done() and not late_entered.is_set()
        await first.__aexit__(None, None, None)
        await asyncio.sleep(0.02)
        assert not newer.done()                                   # the second write is still under way
        await second.__aexit__(None, None, None)
        await asyncio.wait_for(newer, 1)
        assert await asyncio.wait_for(third, 1) == 2              # after the new epoch, which it sees

    asyncio.run(main())


def test_a_new_epoch_cancelled_while_it_waits_lets_writes_through_again():
    async def main():
        p = StepProgress()
        await p.begin(7)
        async with p.gate.write():
            newer = asyncio.ensure_future(p.begin(8))
            await asyncio.sleep(0.02)
            newer.cancel()
            await asyncio.sleep(0.02)
            async with asyncio.timeout(1):
                async with p.gate.write():       # not shut out for ever by the epoch that never began
                    pass
        assert p.generation == 1

    asyncio.run(main())
