"""The model runner: a step's diff applied to the batch, the forward pass, sampling; running one step ahead,
CUDA graphs, tensor-parallel ranks.
Imports every folder below it, nothing of api/.
"""
