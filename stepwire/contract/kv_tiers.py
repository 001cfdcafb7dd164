"""The KV tiers' wire values, which the scheduler (which gives the slots) and the executor (which moves the
blocks) must read alike: the tiers, and the kinds of move a StepRequest's `tier_move_kinds` names."""

HOST, DISK = 0, 1
TIER_NAMES = ("host", "disk")
TO_HOST, TO_DISK, DOWN = 0, 1, 2       # block -> host slot, block -> disk slot, host slot -> disk slot
HASH_BYTES = 32                        # a block's prefix hash (SHA-256)
