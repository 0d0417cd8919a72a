"""What every tokenizer of rlmtrain is: the `Tokenizer` protocol the rollout, the prompt builder
and the trainer use, a chat message, the error for a bad tokenizer or chat, and the check every
chat template runs on its messages. The byte tokenizer (`tokenizer.py`) and the Hugging Face one
(`hf_tokenizer.py`) both build on this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from rlmtrain.errors import UserError

__all__ = ["Message", "Tokenizer", "TokenizerError", "check_messages"]

Message = Mapping[str, Any]


class TokenizerError(UserError, ValueError):
    """A missing or malformed tokenizer file, an unknown token, or an unrenderable chat."""


class Tokenizer(Protocol):
    """What the rollout, the prompt builder and the trainer need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Ids are in [0, vocab_size); the model's embedding may be larger (padded)."""
        ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: EOS and the end-of-turn token."""
        ...

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Text to ids; special-token strings become control tokens only with allow_special."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text, special tokens included; never raises."""
        ...

    def token_to_id(self, token: str) -> int: ...

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The chat as the template writes it, for inspection and logs."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        *,
        sanitize_control_tokens: bool = True,
    ) -> list[int]:
        """The chat's prompt ids; see the module notes on `sanitize_control_tokens`."""
        ...


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Plain dicts without None values: chat APIs send `content=None`, templates expect no key."""
    if not messages:
        raise TokenizerError("cannot render an empty chat: give at least one message")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TokenizerError(
                f"message {index} is not a mapping with a string 'role': {message!r}"
            )
        checked.append({key: value for key, value in message.items() if value is not None})
    return checked
