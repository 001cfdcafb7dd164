"""The model: a Llama-family decoder, its config, rotary embeddings, a rank's slice and collectives, loading
from safetensors, and weights held quantized (GGUF blocks, int8/int4 at load, FP8).
Imports kernels/ and batch/.
"""
