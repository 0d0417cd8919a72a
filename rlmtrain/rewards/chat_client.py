"""An async client for OpenAI-compatible `/v1/chat/completions` endpoints, shared by every judge.

HTTP is httpx's: one `AsyncClient` per event loop, keeping connections alive between calls (up
to `max_concurrency` of them), honouring the usual proxy variables (HTTPS_PROXY, NO_PROXY...),
reading bodies framed any way HTTP/1.1 allows (Content-Length, chunked, until close) and refusing
one cut short. A reply body is read up to 16 MiB; each attempt, connection included, has
`timeout_s` in all.

Structured output: with `judge.response_format = "json_schema"` the request carries the reply
type's JSON schema (from msgspec), which servers with guided decoding (vLLM, OpenAI) enforce; a
server that answers that request with HTTP 400 is asked again with `json_object`, and this client
keeps to that from then on. Whatever the server enforces, every reply is still decoded and
validated here.

What a judge gets from `complete_json`: a reply decoded *and validated* into a msgspec type, or an
`Unscored` carrying the reason. Never a made-up number: a judge that cannot be reached must be
visible to the caller (the peer system this replaces scored such samples 0 and said nothing).

Resilience, in order: a cache keyed by the hash of (model, messages, sampling settings, reply
type) answers repeats without a request (in memory; optionally appended to a JSONL file and read
back on start); a semaphore bounds requests in flight; each attempt has a timeout; timeouts,
connection errors, 429, 5xx and malformed or invalid replies are retried with exponential backoff
and jitter (delay = min(backoff_max, backoff_base·2^attempt) · U(0.5, 1)), a 429/503 Retry-After
raising the delay to what the server asked (capped at backoff_max); other 4xx are not retried.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import msgspec

from rlmtrain import watchdog
from rlmtrain.config import ConfigError, JudgeConfig

__all__ = [
    "ChatClient",
    "ChatStats",
    "JudgeConfig",
    "Unscored",
    "check_served",
    "extract_json_object",
]

T = TypeVar("T")

log = logging.getLogger("rlmtrain")

_MAX_BODY_BYTES = 16 * 1024 * 1024


class Unscored(msgspec.Struct, frozen=True):
    """No reply could be had; `reason` says why (last error after all retries)."""

    reason: str


class ChatStats(msgspec.Struct, kw_only=True):
    requests: int = 0
    """HTTP attempts sent (first tries and retries)."""
    retries: int = 0
    timeouts: int = 0
    failures: int = 0
    """Calls that ended Unscored."""
    cache_hits: int = 0
    connections: int = 0
    """TCP connections opened: fewer than requests when keep-alive works."""


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After as seconds: either delta-seconds or an HTTP date."""
    if not value:
        return None
    if value.strip().isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def extract_json_object(text: str) -> str:
    """The outermost {...} of a reply, so that code fences or a preamble around it do not matter."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError(f"no JSON object in reply {text[:200]!r}")
    return text[start : end + 1]


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    message: _Message


class _Completion(msgspec.Struct):
    choices: list[_Choice]


class _CacheLine(msgspec.Struct):
    key: str
    content: str


class _Retryable(Exception):
    def __init__(self, reason: str, delay_s: float | None = None):
        super().__init__(reason)
        self.delay_s = delay_s


class _Fatal(Exception):
    """A reply that retrying cannot fix (a 4xx other than 429)."""


class _SchemaRefused(Exception):
    """HTTP 400 to a request with a json_schema response format."""


def _schema(reply_type: Any) -> dict[str, Any]:
    """The reply type's JSON schema with the type itself at the root (msgspec puts a $ref there,
    which not every guided-decoding backend follows)."""
    schema = msgspec.json.schema(reply_type)
    defs = schema.get("$defs", {})
    root = schema.get("$ref", "").rpartition("/")[2]
    if root not in defs:
        return schema
    return {**defs[root], "$defs": defs}


class ChatClient:
    """Chat completions with a validated JSON reply; see the module doc for the retry contract."""

    def __init__(self, config: JudgeConfig, *, seed: int | None = None):
        self.config = config
        parts = urlsplit(config.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"judge.base_url must be an http:// or https:// URL, got {config.base_url!r}"
            )
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        self._headers = _auth_headers(config)
        self.stats = ChatStats()
        self._rng = random.Random(seed)
        self._cache: dict[str, str] = {}
        self._cache_file = Path(config.cache_path) if config.cache_path else None
        if self._cache_file is not None and self._cache_file.exists():
            self._load_cache(self._cache_file)
        self._response_format = config.response_format
        self._semaphore: asyncio.Semaphore | None = None
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _load_cache(self, path: Path) -> None:
        decoder = msgspec.json.Decoder(_CacheLine)
        for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{lineno}: bad judge cache line: {exc}") from None
            self._cache[entry.key] = entry.content

    def _remember(self, key: str, content: str) -> None:
        self._cache[key] = content
        if self._cache_file is not None:
            self._cache_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self._cache_file, "ab") as f:
                f.write(msgspec.json.encode(_CacheLine(key, content)) + b"\n")

    def cache_key(self, messages: list[dict[str, str]], reply_type: Any) -> str:
        c = self.config
        blob = msgspec.json.encode(
            [c.model, c.temperature, c.max_tokens, repr(reply_type), messages]
        )
        return hashlib.sha256(blob).hexdigest()

    async def complete_json(
        self,
        messages: list[dict[str, str]],
        reply_type: type[T],
        check: Callable[[T], None] | None = None,
    ) -> T | Unscored:
        """Send `messages`, decode the reply's JSON object as `reply_type`, run `check` on it.

        `check` raises ValueError for a reply that is well-typed but unusable (e.g. a label list
        of the wrong length); that counts as malformed and is retried like one.
        """
        key = self.cache_key(messages, reply_type)
        cached = self._cache.get(key)
        if cached is not None:
            try:
                reply = _decode(cached, reply_type, check)
            except ValueError:
                pass
            else:
                self.stats.cache_hits += 1
                return reply
        self._bind_to_running_loop()
        last_error = ""
        delay_s = 0.0
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self.stats.retries += 1
                await asyncio.sleep(delay_s)
            try:
                content = await self._ask(messages, reply_type)
                reply = _decode(content, reply_type, check)
            except _Retryable as exc:
                last_error = str(exc)
                delay_s = self._backoff(attempt, exc.delay_s)
                continue
            except ValueError as exc:
                last_error = f"malformed reply: {exc}"
                delay_s = self._backoff(attempt, None)
                continue
            except _Fatal as exc:
                self.stats.failures += 1
                return Unscored(str(exc))
            self._remember(key, content)
            return reply
        self.stats.failures += 1
        return Unscored(f"gave up after {self.config.max_retries + 1} attempts: {last_error}")

    def _bind_to_running_loop(self) -> None:
        """A semaphore and a connection pool belong to one event loop; a client reused under a
        new loop (asyncio.run per step, tests) gets fresh ones."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._loop = loop
        self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
        pool = self.config.max_concurrency
        self._http = httpx.AsyncClient(
            headers={"Accept": "application/json", **self._headers},
            timeout=httpx.Timeout(self.config.timeout_s),
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
            trust_env=True,
            event_hooks={"request": [self._on_request]},
        )

    async def _on_request(self, request: httpx.Request) -> None:
        self.stats.requests += 1

    async def _trace(self, event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            self.stats.connections += 1

    async def aclose(self) -> None:
        """Close the connections kept alive (they belong to the loop that made them)."""
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http = self._loop = None

    def _request_body(self, messages: list[dict[str, str]], reply_type: Any) -> bytes:
        c = self.config
        request: dict[str, Any] = {
            "model": c.model,
            "messages": messages,
            "temperature": c.temperature,
            "max_tokens": c.max_tokens,
        }
        if self._response_format == "json_schema":
            request["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": reply_type.__name__, "schema": _schema(reply_type)},
            }
        elif self._response_format == "json_object":
            request["response_format"] = {"type": "json_object"}
        return msgspec.json.encode(request)

    async def _ask(self, messages: list[dict[str, str]], reply_type: Any) -> str:
        """One attempt; a 400 to a json_schema request is asked again at once as json_object,
        and json_object stays the format only if that 400 was about the schema (the second
        request is not refused too)."""
        try:
            return await self._attempt(self._request_body(messages, reply_type))
        except _SchemaRefused as refused:
            self._response_format = "json_object"
            try:
                content = await self._attempt(self._request_body(messages, reply_type))
            except _Fatal:
                self._response_format = "json_schema"
                raise
            log.warning("judge: %s; asking for json_object replies from now on", refused)
            return content

    async def _attempt(self, body: bytes) -> str:
        """One HTTP attempt; returns the reply's message content or raises _Retryable/_Fatal."""
        assert self._semaphore is not None and self._http is not None
        async with self._semaphore:
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    status, headers, payload = await self._post(body)
                watchdog.mark()  # a judge's reply: a rank scoring many holds the others up
            except (TimeoutError, httpx.TimeoutException):
                self.stats.timeouts += 1
                raise _Retryable(f"timeout after {self.config.timeout_s}s") from None
            except httpx.RequestError as exc:  # refused, reset, cut short, not HTTP, undecodable
                raise _Retryable(f"connection error: {type(exc).__name__}: {exc}") from None
        if status == 429 or status >= 500:
            raise _Retryable(
                f"HTTP {status}: {payload[:200]!r}", _retry_after_s(headers.get("retry-after"))
            )
        if status == 400 and self._response_format == "json_schema":
            raise _SchemaRefused(f"HTTP 400 to a json_schema request: {payload[:200]!r}")
        if status != 200:
            raise _Fatal(f"HTTP {status} (not retried): {payload[:200]!r}")
        try:
            completion = msgspec.json.decode(payload, type=_Completion)
        except RecursionError:
            raise _Retryable("completion body nested too deeply") from None
        except msgspec.DecodeError as exc:
            raise _Retryable(f"malformed completion body: {exc}") from None
        if not completion.choices or not completion.choices[0].message.content:
            raise _Retryable("completion has no message content")
        return completion.choices[0].message.content

    async def _post(self, body: bytes) -> tuple[int, httpx.Headers, bytes]:
        assert self._http is not None
        request = self._http.build_request(
            "POST",
            self.url,
            content=body,
            headers={"Content-Type": "application/json"},
            extensions={"trace": self._trace},
        )
        response = await self._http.send(request, stream=True)
        try:
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > _MAX_BODY_BYTES:
                    raise _Retryable(f"reply body over {_MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
        finally:
            await response.aclose()
        return response.status_code, response.headers, b"".join(chunks)

    def _backoff(self, attempt: int, retry_after_s: float | None) -> float:
        c = self.config
        delay = min(c.backoff_max_s, c.backoff_base_s * 2.0**attempt) * self._rng.uniform(0.5, 1.0)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, c.backoff_max_s))
        return delay


class _ModelList(msgspec.Struct):
    data: list[dict[str, Any]]


def _auth_headers(config: JudgeConfig) -> dict[str, str]:
    """The bearer key named by `judge.api_key_env`, if any; ValueError when it is not set."""
    if not config.api_key_env:
        return {}
    key = os.environ.get(config.api_key_env)
    if not key:
        raise ValueError(
            f"judge: environment variable {config.api_key_env!r} (judge.api_key_env) is not set"
        )
    return {"Authorization": f"Bearer {key}"}


def check_served(config: JudgeConfig, timeout_s: float = 10.0) -> None:
    """Before a run leans on the judge (when `judge.base_url` names one): its server answers
    `GET <base_url>/models` and serves `judge.model`, or a ConfigError names the key to fix. A run
    would otherwise find out only after every request of its first batch had spent its retries. A
    server without the listing (404, or a body that is not one) is taken at its word."""
    if not config.base_url:
        return
    url = config.base_url.rstrip("/") + "/models"
    try:
        headers = _auth_headers(config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s, trust_env=True)
    except httpx.InvalidURL as exc:
        raise ConfigError(f"judge.base_url: {config.base_url!r} is not a URL ({exc})") from None
    except httpx.HTTPError as exc:
        raise ConfigError(
            f"judge.base_url: nothing answers at {config.base_url} ({type(exc).__name__}: {exc}); "
            "start the judge's server first (README: Serving a judge)"
        ) from None
    if response.status_code in (401, 403):
        raise ConfigError(
            f"judge.api_key_env: {url} refused the request (HTTP {response.status_code})"
        )
    if response.status_code != 200:
        return
    try:
        served = [
            str(m.get("id")) for m in msgspec.json.decode(response.content, type=_ModelList).data
        ]
    except msgspec.DecodeError:
        return
    if config.model not in served:
        raise ConfigError(
            f"judge.model: {config.model!r} is not served at {config.base_url} "
            f"(it serves {', '.join(map(repr, served)) or 'nothing'})"
        )


def _decode(content: str, reply_type: type[T], check: Callable[[T], None] | None) -> T:
    """Decode and validate a reply's JSON object; every failure is a ValueError. Raw control
    characters inside strings (a newline in a reason), which strict JSON forbids and models
    write, are read as themselves."""
    text = extract_json_object(content)
    try:
        reply = msgspec.json.decode(text, type=reply_type)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None
    except RecursionError:
        raise ValueError("reply nested too deeply") from None
    except msgspec.DecodeError as exc:
        try:
            reply = msgspec.convert(json.loads(text, strict=False), type=reply_type)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError(str(exc)) from None
        except msgspec.ValidationError as invalid:
            raise ValueError(str(invalid)) from None
    if check is not None:
        check(reply)
    return reply
