"""Incremental detokenization: text deltas that never split a multi-byte character.

Byte-level BPE tokens can end in the middle of a UTF-8 sequence; decoding such a prefix yields U+FFFD.
Each push decodes a short window of recent tokens twice (with and without the new ones) and releases
only the text past the window once it no longer ends in a replacement character.
"""

from __future__ import annotations

from gateway.tokenizer import ModelTokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: ModelTokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0   # start of the decoding window
        self.read_offset = 0     # tokens whose text has been released

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        decode = self.tok.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back when generation ends (an incomplete character stays U+FFFD)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
