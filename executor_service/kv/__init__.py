"""KV cache that lives and moves: the cache tensors, blocks as bytes, shared memory, the copy engine, and
PullBlocks / ReadBlocks between executors.
Imports model/ (its config) and nothing above.
"""
