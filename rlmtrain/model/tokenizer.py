"""Tokenizers and chat templates behind one small interface.

Two backends share the `Tokenizer` protocol: `ByteTokenizer` (here) needs no files: ids 0..255
are UTF-8 bytes, a few ChatML special tokens follow, and the whole vocabulary fits the `tiny`
preset's 384-row embedding; `HFTokenizer` (`model/hf_tokenizer.py`) reads a checkpoint's
`tokenizer.json` and renders its Jinja chat template as transformers does.

Text in, text out is always plain: `encode` never turns special-token strings into control tokens
unless asked (`allow_special=True`), because REPL output and model-written code routinely contain
strings like `<|im_end|>` and must not be able to end a turn or forge a role. For the same reason
`apply_chat_template` by default encodes control tokens that appear *inside message strings* as
text, and only those the template writes itself as tokens (transformers'
`sanitize_control_tokens=True`); `sanitize_control_tokens=False` gives transformers' default.
Errors name the file or the message at fault.

`with_chat_template_kwargs` binds `rollout.chat_template_kwargs` (Qwen3's `enable_thinking`) to a
tokenizer: the scheduler binds them, so every rollout, evaluation and teacher tree (the SFT
samples) renders with them, and the commands bind them as the tokenizer loads, so a tokenizer
that cannot use them is refused before a model loads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from rlmtrain.config import ConfigError
from rlmtrain.model.chat import Message, Tokenizer, TokenizerError, check_messages
from rlmtrain.model.hf_tokenizer import HFTokenizer

__all__ = [
    "ByteTokenizer",
    "Message",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "with_chat_template_kwargs",
]

T = TypeVar("T")


def load_tokenizer(spec: str, hf_dir: str = "") -> Tokenizer:
    """Resolve `ModelConfig.tokenizer`: 'byte', a folder with tokenizer.json, or '' for hf_dir's."""
    if spec == "byte":
        return ByteTokenizer()
    if spec:
        return HFTokenizer.from_dir(spec)
    if not hf_dir:
        raise TokenizerError(
            "model.tokenizer is empty (use hf_dir's tokenizer) but model.hf_dir is empty too; "
            "set model.tokenizer to 'byte' or to a folder with tokenizer.json"
        )
    return HFTokenizer.from_dir(hf_dir)


def with_chat_template_kwargs(tokenizer: T, kwargs: Mapping[str, Any]) -> T:
    """`tokenizer` rendering every chat with `kwargs` (`rollout.chat_template_kwargs`) as extra
    chat-template variables, replacing any bound before; a tokenizer other than `HFTokenizer` is
    returned as it is when `kwargs` is empty. ConfigError naming the key when the tokenizer
    cannot use them: no Jinja template (the byte tokenizer's fixed ChatML), a name the renderer
    sets itself, or a name the template never reads (the trained BPE's ChatML template reads
    none)."""
    if isinstance(tokenizer, HFTokenizer):
        try:
            return tokenizer.with_template_kwargs(kwargs)
        except TokenizerError as exc:
            raise ConfigError(f"rollout.chat_template_kwargs: {exc}") from exc
    if kwargs:
        raise ConfigError(
            f"rollout.chat_template_kwargs: {type(tokenizer).__name__} writes a fixed ChatML "
            f"format, with no chat template to pass {', '.join(map(repr, kwargs))} to; leave "
            "it {} or use a tokenizer folder with a chat template"
        )
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Byte-level tokenizer for the tiny preset
# ---------------------------------------------------------------------------------------------

BYTE_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    *(f"<|reserved_{i}|>" for i in range(5)),
)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then `BYTE_SPECIAL_TOKENS`; ChatML chat format.

    EOS and padding are `<|endoftext|>`; a turn ends with `<|im_end|>`; there is no BOS (as in
    Qwen). Ids outside the vocabulary decode to U+FFFD, so sampling from a padded embedding
    cannot crash a rollout.
    """

    def __init__(self) -> None:
        self._special_ids = {token: 256 + i for i, token in enumerate(BYTE_SPECIAL_TOKENS)}
        self._special_re = re.compile("|".join(map(re.escape, BYTE_SPECIAL_TOKENS)))
        self._im_start = self._special_ids["<|im_start|>"]
        self._im_end = self._special_ids["<|im_end|>"]

    @property
    def vocab_size(self) -> int:
        return 256 + len(BYTE_SPECIAL_TOKENS)

    @property
    def bos_id(self) -> int | None:
        return None

    @property
    def eos_id(self) -> int:
        return self._special_ids["<|endoftext|>"]

    @property
    def pad_id(self) -> int:
        return self.eos_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id, self._im_end)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if not allow_special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        start = 0
        for match in self._special_re.finditer(text):
            ids += text[start : match.start()].encode("utf-8")
            ids.append(self._special_ids[match.group()])
            start = match.end()
        ids += text[start:].encode("utf-8")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        pieces: list[str] = []
        pending = bytearray()
        for token_id in ids:
            token_id = int(token_id)
            if 0 <= token_id < 256:
                pending.append(token_id)
                continue
            # A special token or a stray id ends the byte run: decode it before, not across.
            pieces.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            in_vocab = 256 <= token_id < self.vocab_size
            pieces.append(BYTE_SPECIAL_TOKENS[token_id - 256] if in_vocab else "\ufffd")
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def token_to_id(self, token: str) -> int:
        if token in self._special_ids:
            return self._special_ids[token]
        raw = token.encode("utf-8")
        if len(raw) == 1:
            return raw[0]
        raise TokenizerError(f"{token!r} is not a token of the byte tokenizer")

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        parts = [
            f"<|im_start|>{role}\n{content}<|im_end|>\n"
            for role, content in self._roles_and_contents(messages)
        ]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        *,
        sanitize_control_tokens: bool = True,
    ) -> list[int]:
        if not sanitize_control_tokens:
            return self.encode(
                self.render_chat(messages, add_generation_prompt), allow_special=True
            )
        newline = self.encode("\n")
        ids: list[int] = []
        for role, content in self._roles_and_contents(messages):
            ids += [self._im_start, *self.encode(role), *newline]
            ids += [*self.encode(content), self._im_end, *newline]
        if add_generation_prompt:
            ids += [self._im_start, *self.encode("assistant"), *newline]
        return ids

    def _roles_and_contents(self, messages: Sequence[Message]) -> list[tuple[str, str]]:
        pairs = []
        for index, message in enumerate(check_messages(messages)):
            unrendered = sorted(set(message) - {"role", "content"})
            if unrendered:
                raise TokenizerError(
                    f"message {index}: the byte tokenizer's ChatML template renders only role and "
                    f"content, not {', '.join(unrendered)}"
                )
            content = message.get("content", "")
            if not isinstance(content, str):
                raise TokenizerError(
                    f"message {index}: the byte tokenizer's ChatML template needs string content, "
                    f"got {type(content).__name__}"
                )
            pairs.append((message["role"], content))
        return pairs
