"""Incremental detokenization: text deltas that never split a multi-byte character.

Byte-level BPE tokens can end in the middle of a UTF-8 sequence; decoding such a prefix yields U+FFFD.
`tokenizers`' DecodeStream holds tokens back until their text no longer ends in one, and decodes them
together with the tokens it last released, so that decoders which treat a sequence's first token
differently (a leading space dropped) still join up.

Skipping special tokens skips them all, but one may be the start of the model's tool calls (Mistral's
[TOOL_CALLS]): the tokenizer's `kept_token_ids` come out as text all the same (gateway.text.tool_family).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from gateway.text.tokenizer import ModelTokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: ModelTokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.keep = tokenizer.kept_token_ids if skip_special_tokens else frozenset()
        # DecodeStream keeps both lists inside and offers no flush; flush() needs them to release what is held.
        self.released: list[int] = []   # the tokens behind the last text released: the context of the next ones
        self.held: list[int] = []       # tokens pushed since, whose text is not out yet

    def push(self, new_ids: list[int]) -> str:
        # One step per token, not one for the list: the complete characters before a split one come out now.
        out = []
        for token_id in new_ids:
            if token_id in self.keep:
                # Its text in its place. The stream never sees it: skipped, it would not have changed the context
                # of the tokens after it either. What is held before it cannot complete across it, so it goes first.
                if self.held:
                    out.append(self.flush())
                out.append(self.tok.token_text(token_id))
                continue
            self.held.append(token_id)
            text = self.stream.step(self.tok.tokenizer, token_id)
            if text is not None:
                out.append(text)
                self.released, self.held = self.held, []
        return "".join(out)

    def flush(self) -> str:
        """Whatever is still held back when generation ends (an incomplete character stays U+FFFD)."""
        context = self.tok.decode(self.released, self.skip)
        text = self.tok.decode(self.released + self.held, self.skip)[len(context):]
        self.stream = DecodeStream(skip_special_tokens=self.skip)
        self.released, self.held = [], []
        return text
