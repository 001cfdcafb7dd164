"""KV blocks and the free-block queue they thread through.

The queue is an intrusive doubly-linked list: each block carries its own prev/next pointers, so a
prefix-cache hit can pull a block out of the middle in O(1) (`remove`), which a deque cannot do. The
front of the queue is evicted first; cached blocks are appended at the back, so the queue is also the LRU
order of the prefix cache.
"""

from __future__ import annotations


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null", "freed_at")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is in the prefix cache; cleared only when the block is reused (lazy eviction).
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False
        self.freed_at = -1          # the newest step sent when it was last freed (BlockPool.clock); -1: never

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """All blocks with ref_cnt == 0, in eviction order. Sentinels at both ends keep every link op branch-free."""

    __slots__ = ("num_free_blocks", "_head", "_tail")

    def __init__(self, blocks: list[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("pop from an empty free-block queue")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise IndexError(f"cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        out = []
        block = self._head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None:
            raise ValueError(f"{block} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if not blocks:
            return
        last = self._tail.prev_free
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the front, in order: they are the next to be handed out."""
        if not blocks:
            return
        first = self._head.next_free
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = first
        first.prev_free = prev
        self.num_free_blocks += len(blocks)

    def blocks(self) -> list[KVCacheBlock]:
        """The queue front to back (for tests and debugging; O(n))."""
        out = []
        block = self._head.next_free
        while block is not self._tail:
            out.append(block)
            block = block.next_free
        return out

    def _unlink(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
