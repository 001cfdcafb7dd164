"""Tool calling: the request's tools, their schemas, rendering into the prompt, parsing calls out of the text.
Imports nothing else of the gateway.
"""
