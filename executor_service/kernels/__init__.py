"""The executor's compute kernels: fixed-order CPU GEMM and attention (fixed_order.c), paged attention in torch
and Triton, deterministic mode's kernels, fused CUDA kernels, the linear layers' GEMM choice.
Imports nothing else of the executor.
"""
