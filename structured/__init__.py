"""Structured output, shared by the gateway (to refuse a grammar at the edge) and the executor (to enforce it).

`grammar.py` turns a `stepwire.internal.StructuredOutput` (JSON schema, JSON object, regex, choice, Lark/GBNF
grammar, structural tags) into llguidance's grammar text; `compiler.py` compiles it for one tokenizer, bounded
in work and time, cached, off the caller's thread. It imports no service and no torch: the gateway stays light.
"""

from structured.compiler import Compiler, compiler_for
from structured.grammar import grammar_of

__all__ = ["Compiler", "compiler_for", "grammar_of"]
