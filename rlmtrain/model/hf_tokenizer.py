"""A Hugging Face tokenizer folder: `tokenizer.json` through the `tokenizers` library and the
chat template rendered as transformers' `apply_chat_template` renders it (sandboxed environment,
`trim_blocks`/`lstrip_blocks`, `raise_exception`, a `tojson` that keeps non-ASCII, the
special-token variables), so the prompt ids sent to an engine are the ids the model saw in
training. `chat_template.jinja` wins over `tokenizer_config.json`'s entry, as in transformers.
Control tokens inside message strings are encoded as text by default, piece for piece as
transformers' `sanitize_control_tokens=True` does (see `model/tokenizer.py`).

Extra template variables (Qwen3's `enable_thinking`, `rollout.chat_template_kwargs`) are bound
once, `with_template_kwargs`, and then go to every render, so a run's SFT samples, rollouts and
evaluation share one prompt format. A name the template never reads is refused rather than
ignored (a typo, or a switch of another model family, would otherwise change nothing silently),
and so is one the renderer sets itself (`RENDER_VARIABLES`).

Refused on purpose: `tokenizer.json`-less (SentencePiece-only) checkpoints, the `tools=` schema
(the RLM scaffold puts tools in the REPL, not in the prompt), and batched calls.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rlmtrain.model.chat import Message, TokenizerError, check_messages

__all__ = ["RENDER_VARIABLES", "HFTokenizer"]


# transformers' template variables for the named special tokens (`special_tokens_map`).
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Variables every render sets itself, as transformers' `apply_chat_template` does, and the
# environment's globals: an extra template variable of one of these names would replace it.
RENDER_VARIABLES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "tools",
        "documents",
        *_SPECIAL_TOKEN_KEYS,
        "raise_exception",
        "strftime_now",
        "namespace",
    }
)

# Tokens that close an assistant turn in the common chat formats (ChatML/Qwen, Llama 3, Gemma,
# Phi-3); a checkpoint's EOS is often the end-of-document token instead.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")

# Private-use code points that bracket control tokens found in message strings while the template
# renders; the same ones transformers uses, so a message containing them is treated alike.
_MARK_START = "\U000f0000"
_MARK_END = "\U000f0001"


class _GenerationBlock(jinja2.ext.Extension):
    """Parse `{% generation %}...{% endgeneration %}` (assistant-mask markers) as a plain block."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses dunder-like names, a sandbox escape route."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named `self`, as in jinja's Namespace, so that `namespace(self=...)` still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes on a namespace: {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _chat_template_from(folder: Path, config: dict[str, Any], config_path: Path) -> str | None:
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    # Older configs list named templates: [{"name": "default", "template": "..."}, ...].
    if isinstance(template, list):
        named = {
            entry.get("name"): entry.get("template")
            for entry in template
            if isinstance(entry, dict)
        }
        if isinstance(named.get("default"), str):
            return named["default"]
    raise TokenizerError(
        f"{config_path}: chat_template is neither a string nor has a 'default' entry"
    )


def _generation_eos_ids(path: Path) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list, e.g. Qwen's [im_end, endoftext])."""
    if not path.is_file():
        return []
    eos = _read_json(path).get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise TokenizerError(f"{path}: eos_token_id must be an id or a list of ids, got {eos!r}")
    return ids


def _without_added_tokens(tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A copy that cannot match any added token, special or not (transformers' "split" encode).

    Its ids are those of normalize -> pre-tokenize -> model, the pipeline transformers runs by hand
    for `_encode_without_added_tokens`; one Rust call instead of one per pre-token.
    """
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialised AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face tokenizer folder: `tokenizer.json`, `tokenizer_config.json`, optional
    `chat_template.jinja` and `generation_config.json` (its extra EOS ids join `stop_ids`)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
        extra_stop_ids: Sequence[int] = (),
        source: str = "<memory>",
    ) -> None:
        """`special_tokens` maps transformers' names (eos_token, ...) to token strings."""
        self._tok = tokenizer
        # Checkpoints sometimes save truncation or padding settings that would silently cut or
        # pad every encode; the trainer does its own packing.
        self._tok.no_truncation()
        self._tok.no_padding()
        self._plain = _without_added_tokens(self._tok)
        self._source = source
        self._special_tokens = dict(special_tokens)
        self._chat_template = chat_template
        self._template_kwargs: dict[str, Any] = {}
        if "eos_token" not in self._special_tokens:
            raise TokenizerError(
                f"{source}: no eos_token (tokenizer_config.json) nor eos_token_id "
                "(generation_config.json)"
            )
        self._eos_id = self.token_to_id(self._special_tokens["eos_token"])
        bos = self._special_tokens.get("bos_token")
        self._bos_id = self.token_to_id(bos) if bos is not None else None
        pad = self._special_tokens.get("pad_token")
        self._pad_id = self.token_to_id(pad) if pad is not None else self._eos_id
        end_of_turn = [
            i for t in _END_OF_TURN_TOKENS if (i := self._tok.token_to_id(t)) is not None
        ]
        self._stop_ids = tuple(dict.fromkeys([self._eos_id, *extra_stop_ids, *end_of_turn]))

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder {folder} does not exist or is not a folder")
        tokenizer_path = folder / "tokenizer.json"
        config_path = folder / "tokenizer_config.json"
        for required in (tokenizer_path, config_path):
            if not required.is_file():
                raise TokenizerError(f"{required}: missing (a tokenizer folder needs it)")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises a bare Exception for any parse error
            raise TokenizerError(f"{tokenizer_path}: not a valid tokenizer.json ({exc})") from exc
        config = _read_json(config_path)
        special_tokens = {}
        for key in _SPECIAL_TOKEN_KEYS:
            if config.get(key) is None:
                continue
            content = _token_content(config[key])
            if content is None:
                raise TokenizerError(f"{config_path}: {key} is neither a string nor an AddedToken")
            special_tokens[key] = content
        extra_stop_ids = _generation_eos_ids(folder / "generation_config.json")
        if "eos_token" not in special_tokens and extra_stop_ids:
            eos_token = tokenizer.id_to_token(extra_stop_ids[0])
            if eos_token is not None:
                special_tokens["eos_token"] = eos_token
        return cls(
            tokenizer,
            special_tokens=special_tokens,
            chat_template=_chat_template_from(folder, config, config_path),
            extra_stop_ids=extra_stop_ids,
            source=str(folder),
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        tokenizer = self._tok if allow_special else self._plain
        return tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        vocab_size = self.vocab_size
        if all(0 <= i < vocab_size for i in ids):
            return self._tok.decode(ids, skip_special_tokens=False)
        # A padded embedding row (Qwen's 151936 rows hold 151669 tokens) or a negative id: the
        # library would drop the one and raise on the other; show U+FFFD as ByteTokenizer does.
        pieces: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if 0 <= token_id < vocab_size:
                run.append(token_id)
                continue
            pieces += [self._tok.decode(run, skip_special_tokens=False), "\ufffd"]
            run = []
        pieces.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(pieces)

    def token_to_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{token!r} is not in the vocabulary of {self._source}")
        return token_id

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The extra variables every render passes to the chat template."""
        return dict(self._template_kwargs)

    @cached_property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (those it never sets itself)."""
        ast = self._template.environment.parse(self._chat_template)
        return frozenset(jinja2.meta.find_undeclared_variables(ast))

    def with_template_kwargs(self, kwargs: Mapping[str, Any]) -> HFTokenizer:
        """A copy of this tokenizer whose every render passes `kwargs` to the chat template, as
        transformers' `apply_chat_template(..., **kwargs)` does (they replace any bound before).
        TokenizerError for a folder without a chat template, a name in `RENDER_VARIABLES`, or a
        name the template never reads."""
        if kwargs:
            taken = sorted(set(kwargs) & RENDER_VARIABLES)
            if taken:
                raise TokenizerError(
                    f"{', '.join(map(repr, taken))}: the renderer sets that template variable "
                    "itself (messages, add_generation_prompt, tools, documents, the special "
                    "tokens); use another name"
                )
            unread = sorted(set(kwargs) - self.template_variables)
            if unread:
                raise TokenizerError(
                    f"the chat template of {self._source} never reads "
                    f"{', '.join(map(repr, unread))}, so setting it would change nothing"
                )
        bound = copy.copy(self)
        bound._template_kwargs = dict(kwargs)
        return bound

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        return self._render(check_messages(messages), add_generation_prompt)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        *,
        sanitize_control_tokens: bool = True,
    ) -> list[int]:
        checked = check_messages(messages)
        if not sanitize_control_tokens:
            return self.encode(self._render(checked, add_generation_prompt), allow_special=True)
        marked = [self._mark_control_tokens(message) for message in checked]
        return self._encode_marked(self._render(marked, add_generation_prompt))

    # -- chat template ------------------------------------------------------------------------

    @cached_property
    def _template(self) -> jinja2.Template:
        if self._chat_template is None:
            raise TokenizerError(
                f"{self._source} has no chat template (neither chat_template.jinja nor "
                "tokenizer_config.json's chat_template)"
            )
        try:
            return _template_environment().from_string(self._chat_template)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"chat template of {self._source}: line {exc.lineno}: {exc}"
            ) from exc

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
                **self._template_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template of {self._source}: {exc}") from exc

    # -- control tokens in message strings ----------------------------------------------------

    @cached_property
    def _control_tokens(self) -> tuple[str, ...]:
        """Special added tokens, plus non-special ones the template writes (Qwen's `<think>`).

        As in transformers: whitespace tokens are left out (templates write them as text), and a
        token the template builds from pieces is not found, only literal ones.
        """
        ast = self._template.environment.parse(self._chat_template)
        literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
        literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
        literal_text = "\0".join(literals)
        return tuple(
            token.content
            for token in self._tok.get_added_tokens_decoder().values()
            if token.special or (token.content in literal_text and not token.content.isspace())
        )

    @cached_property
    def _control_token_re(self) -> re.Pattern[str]:
        # Longest first, so a token wins over the tokens it contains; "(?!)" never matches.
        longest_first = sorted(self._control_tokens, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")

    @cached_property
    def _marker_re(self) -> re.Pattern[str]:
        # A marked token, or a lone marker left when a template's string method split a pair.
        tokens = self._control_token_re.pattern
        return re.compile(f"{_MARK_START}({tokens}){_MARK_END}|[{_MARK_START}{_MARK_END}]")

    def _mark_control_tokens(self, value: Any) -> Any:
        """Bracket the control tokens in every string value (not dict keys) with the markers."""
        if isinstance(value, str):
            value = value.replace(_MARK_START, "").replace(_MARK_END, "")
            return self._control_token_re.sub(f"{_MARK_START}\\g<0>{_MARK_END}", value)
        if isinstance(value, Mapping):
            return {key: self._mark_control_tokens(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self._mark_control_tokens(item) for item in value]
        return value

    def _encode_marked(self, chat: str) -> list[int]:
        """Encode a chat rendered from marked messages: marked tokens as text, the rest as usual.

        `re.split` with one group yields [text, token, text, token, ..., text], None standing for
        a lone marker. Pieces after the first are encoded behind a newline that is then dropped,
        so SentencePiece-style tokenizers do not add their start-of-text space to each piece.
        """
        pieces = self._marker_re.split(chat)
        newline_ids = self.encode("\n", allow_special=True)
        ids = self.encode(pieces[0], allow_special=True)
        for index, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = index % 2 == 1
            piece_ids = self.encode("\n" + piece, allow_special=not as_text)
            if piece_ids[: len(newline_ids)] == newline_ids:
                piece_ids = piece_ids[len(newline_ids) :]
            else:
                piece_ids = self.encode(piece, allow_special=not as_text)
            if as_text and self.token_to_id(piece) in piece_ids:
                raise TokenizerError(
                    f"cannot encode {piece!r} in a message as text: {self._source}'s tokenizer "
                    "produces that control token from plain text"
                )
            ids += piece_ids
        return ids
