"""The served model's tokenizer and chat template, read from its Hugging Face directory."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.text.reasoning import reasoning_format
from gateway.text.tool_family import marker_ids, resolve
from stepwire.contract import InvalidRequestError


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


# The variables the gateway itself gives a template: a request's chat_template_kwargs may not set them (nor the
# environment's globals: range, namespace, raise_exception...).
RENDER_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


class ModelTokenizer:
    def __init__(self, model_dir: str | Path, reasoning_parser: str = "auto", tool_call_parser: str = "auto"):
        model_dir = Path(model_dir)
        self.path = model_dir / "tokenizer.json"   # also read by the grammar compiler (structured output)
        self.tokenizer = Tokenizer.from_file(str(self.path))
        cfg_file = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        # The template conventions of Hugging Face: a sandbox, trimmed blocks, raise_exception, loop controls.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        # Templates write tools and call arguments with tojson, meaning plain JSON (Jinja's own escapes < > & '
        # for HTML, which would put "\u003c" in front of the model instead of "<").
        env.filters["tojson"] = _tojson
        self.chat_template = env.from_string(template) if template else None
        self.reserved = RENDER_VARIABLES | frozenset(env.globals)
        # Whether the template renders tools itself (it reads the `tools` variable); gateway.tools.rendering
        # renders them into the system prompt for one that does not.
        self.knows_tools = bool(template) and "tools" in meta.find_undeclared_variables(env.parse(template))
        # Whether the output is read for a <think> block (gateway.text.reasoning): the flag, or the template's.
        self.reasoning = reasoning_format(self._sample_prompt if template else None, reasoning_parser)
        # The family whose format "auto" tool calls are asked for and read in (gateway.text.tool_family): the
        # flag's, or the template's; and the special token of that format the detokenizer must not skip.
        self.tool_format = resolve(template, self.knows_tools, tool_call_parser)
        self.kept_token_ids = marker_ids(self.tokenizer, self.tool_format)
        self.special_markers = {self.token_text(i): i for i in self.kept_token_ids}   # by text, for the constraint
        self.max_token_bytes = _longest_token_bytes(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def text_bytes(self, text: str) -> int:
        """A lower bound on the bytes of `text` that the model's tokens cover, each at most
        `max_token_bytes`: a text with more than n * max_token_bytes needs more than n tokens. Raises
        UnicodeEncodeError for a string that is not valid Unicode (JSON's \\ud800 escapes carry lone
        surrogates), which nothing downstream could encode."""
        size = len(text.encode())
        if self.tokenizer.normalizer is not None:
            # A normalizer may shrink the text (NFC folds 'e' and a combining accent, 3 bytes, into the
            # 2-byte 'é'); tokens then cover what it leaves. One that grows it (SentencePiece's ' ' to '▁')
            # is undone by the decoder the bound was measured with, so the input's own length holds there.
            size = min(size, len(self.tokenizer.normalizer.normalize_str(text).encode()))
        return size

    def refuse_oversize(self, text: str, limit: int, field: str, max_model_len: int) -> None:
        """InvalidRequestError naming `field` when `text` is more than `limit` bytes (0: no limit), so it
        cannot fit a context of `max_model_len` tokens, or is not valid Unicode: refused before the tokenizer
        spends any time on it."""
        try:
            size = self.text_bytes(text)
        except UnicodeEncodeError:
            raise InvalidRequestError(field, "the text is not valid Unicode (it holds a lone surrogate)") from None
        if limit and size > limit:
            raise InvalidRequestError(field, f"this model's maximum context length is {max_model_len} tokens; "
                                             f"a text of {size} bytes cannot fit it (at most {limit} bytes can)")

    def check_template_kwargs(self, kwargs: dict | None, field: str = "chat_template_kwargs") -> dict | None:
        """A request's extra template variables: identifiers, none of them the gateway's own or a global."""
        if not kwargs:
            return None
        for name in kwargs:
            if not name.isidentifier() or name in self.reserved:
                raise InvalidRequestError(f"{field}.{name[:40]}", "a template variable of the request's own, not "
                                          f"one of {', '.join(sorted(self.reserved))}")
        return kwargs

    def _sample_prompt(self, **extra) -> str:
        """The generation prompt of a one-message chat: what the template writes where the model starts."""
        return self.render_chat([{"role": "user", "content": "Hi"}], extra=extra)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, extra: dict | None = None) -> str:
        """`extra`: a request's chat_template_kwargs (checked by check_template_kwargs), more variables for the
        template (Qwen3's enable_thinking)."""
        if self.chat_template is None:
            raise ChatTemplateError("the model has no chat template; use completions instead")
        try:
            return self.chat_template.render(**(extra or {}), messages=messages,
                                             add_generation_prompt=add_generation_prompt,
                                             bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                             tools=tools)
        except TemplateError as e:   # the sandbox's refusals included
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        except ChatTemplateError:
            raise                       # the template's own raise_exception
        except Exception as e:  # noqa: BLE001 — a template's own code failing on a request's values (a variable of
            # the wrong type) is the request's to fix, not a crash of the gateway
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {str(e)[:200]}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The rendered template already holds its special tokens.
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most bytes of input text one token stands for, measured once over the whole vocabulary.

    Each token is decoded after an ordinary one, as it would follow it in a text: decoded alone, a
    SentencePiece token loses its leading space ('▁the' is 'the' first, ' the' later). Decoding never
    shortens what a token covers (an incomplete UTF-8 sequence becomes the 3-byte U+FFFD), so the bound is
    safe; for byte-level BPE (GPT-2, Llama 3, SmolLM) it is exact. A pre-tokenizer that drops whitespace
    (BERT's) would break it, but no generative model's tokenizer does that."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    before = tokenizer.encode("a", add_special_tokens=False).ids[-1:]
    start = len(tokenizer.decode(before, skip_special_tokens=False).encode())
    decoded = tokenizer.decode_batch([[*before, i] for i in vocab.values()], skip_special_tokens=False)
    return max(len(s.encode()) for s in decoded) - start


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value
