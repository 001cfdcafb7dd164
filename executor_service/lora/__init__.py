"""LoRA adapters on the executor: reading and checking an adapter, device slots, the batched products.
Imports model/ and batch/.
"""
