"""Speculative decoding on the executor: n-gram proposals, verification, and the draft model.
Imports model/, kv/, batch/ and kernels/.
"""
