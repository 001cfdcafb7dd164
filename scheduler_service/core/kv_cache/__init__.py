"""Paged KV-cache bookkeeping: blocks and the free queue, the block pool with its prefix cache, the manager."""
