"""OpenAI-compatible HTTP: routes, request bodies, response shapes, /tokenize, LoRA routes.
Imports generation/ and below.
"""
