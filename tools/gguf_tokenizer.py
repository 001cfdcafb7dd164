"""The tokenizer a GGUF file describes, rebuilt as a Hugging Face `tokenizers` pipeline.

A GGUF carries no `tokenizer.json`: llama.cpp keeps the vocabulary, the merges, the token kinds and the
special ids as metadata, and names the pre-tokenizer (`tokenizer.ggml.pre`) instead of storing it. We
rebuild byte-level BPE from those, the way llama.cpp tokenizes it:

- the vocabulary and merges as stored, with no unknown token (every byte has a token);
- the split rules llama.cpp applies for the named pre-tokenizer (see `_pre_tokenizer`);
- control tokens (`<|im_start|>` ...) as special added tokens, user-defined ones as plain added tokens,
  so that both are matched whole in the text instead of being cut into bytes;
- BOS/EOS added around a sequence only when the file says so.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is handled: that is what SmolLM2, Llama 3 and
Qwen2 files use. SentencePiece vocabularies (Llama 2, Mistral v0.1) are refused with a clear message.
"""

from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from tools.gguf_reading import ConversionError, require

# Pre-tokenizer names (`tokenizer.ggml.pre`) for which llama.cpp isolates every digit before applying
# GPT-2's split (llama-vocab.cpp). SmolLM2's own tokenizer.json does the same (Digits, then ByteLevel).
# transformers' GGUF loader (5.x) omits the digit step for "smollm"; ids then differ only where a run of
# spaces precedes a digit ("a  1": llama.cpp and SmolLM2 give "ĠĠ", "1"; transformers "Ġ", "Ġ", "1").
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})

# Pre-tokenizers that split with a regex of their own instead of GPT-2's (the patterns are those the
# models' published tokenizer.json files use).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, the alphabet byte-level BPE vocabularies are spelled in.

    Bytes that are visible Latin-1 characters stand for themselves; the rest (controls, space, ...) are
    moved to code points from U+0100 up, in byte order, so that no token contains whitespace.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: chr(byte) for byte in visible}
    hidden = (byte for byte in range(256) if byte not in alphabet)
    alphabet.update((byte, chr(256 + offset)) for offset, byte in enumerate(hidden))
    return alphabet


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the one llama.cpp builds from this file's metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConversionError(
            f"the GGUF tokenizer is {kind!r}; only byte-level BPE ('gpt2', as in SmolLM2, Llama 3, Qwen2) is supported"
        )
    tokens = require(metadata, "tokenizer.ggml.tokens")
    vocab = _vocabulary(tokens)
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=_merges(metadata), fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata)
    _add_whole_tokens(tokenizer, vocab, tokens, metadata.get("tokenizer.ggml.token_type"))
    return tokenizer


def tokenizer_config(metadata: dict[str, Any], model_max_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` that tells transformers (and our gateway) how to use `tokenizer.json`."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        **special_tokens(metadata),
        "model_max_length": model_max_length,
        # Byte-level BPE decodes spaces exactly; the legacy clean-up would drop the space before "." and "'s".
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def special_tokens(metadata: dict[str, Any]) -> dict[str, str]:
    """The text of the BOS/EOS/UNK/PAD tokens the file names (those it names)."""
    tokens = metadata.get("tokenizer.ggml.tokens", [])
    named = {}
    for role, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(key)
        if token_id is not None and 0 <= token_id < len(tokens):
            named[role] = tokens[token_id]
    return named


def _vocabulary(tokens: list[str]) -> dict[str, int]:
    """Token text to id, every token spelled in the byte alphabet.

    A few converters store a token (usually a special one) as raw text with characters outside the
    alphabet; BPE could never produce it from bytes, so it is respelled byte by byte.
    """
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    respell = lambda token: "".join(alphabet[byte] for byte in token.encode("utf-8"))
    return {token if set(token) <= letters else respell(token): index for index, token in enumerate(tokens)}


def _merges(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    """The merge rules, best first. Byte-level tokens never contain a space, so one space separates a pair."""
    pairs = []
    for rule in require(metadata, "tokenizer.ggml.merges"):
        left, sep, right = rule.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ConversionError(f"the GGUF merge rule {rule!r} is not a pair of tokens separated by one space")
        pairs.append((left, right))
    return pairs


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """How text is cut into words before BPE runs on each, after llama.cpp's rules for `name`."""
    if name in _REGEX_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLITS[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if name in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    # "gpt2", "default" and names we do not know: GPT-2's split, which is also llama.cpp's fallback.
    return gpt2


def _post_processor(metadata: dict[str, Any]) -> processors.TemplateProcessing:
    """Adds BOS/EOS around an encoded sequence exactly when the file asks for it (SmolLM2 asks for neither)."""
    tokens = metadata["tokenizer.ggml.tokens"]
    around: dict[str, tuple[str, int]] = {}
    for end in ("bos", "eos"):
        token_id = metadata.get(f"tokenizer.ggml.{end}_token_id")
        if metadata.get(f"tokenizer.ggml.add_{end}_token", False) and token_id is not None:
            around[end] = (tokens[token_id], token_id)
    before = [around["bos"][0]] if "bos" in around else []
    after = [around["eos"][0]] if "eos" in around else []
    return processors.TemplateProcessing(
        single=[*before, "$A", *after],
        pair=[*before, "$A", *after, "$B:1", *after],
        special_tokens=list(around.values()),
    )


def _add_whole_tokens(tokenizer: Tokenizer, vocab: dict[str, int], tokens: list[str], token_types: list[int] | None):
    """Registers control and user-defined tokens so they are matched whole in input text.

    A token whose text had to be respelled for the vocabulary is skipped: its raw text has no id, so
    adding it would create a new id past the end of the model's embedding table.
    """
    if not token_types:
        return
    kept = [
        (token, kind)
        for index, (token, kind) in enumerate(zip(tokens, token_types, strict=False))
        if vocab.get(token) == index
    ]
    whole = lambda kind, special: [AddedToken(t, special=special, normalized=False) for t, k in kept if k == kind]
    tokenizer.add_special_tokens(whole(TokenType.CONTROL, special=True))
    tokenizer.add_tokens(whole(TokenType.USER_DEFINED, special=False))
