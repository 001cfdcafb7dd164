"""Text in and out: the model's tokenizer and chat template, incremental detokenization, stop strings.
Imports nothing else of the gateway.
"""
