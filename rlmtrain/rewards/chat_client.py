"""An async client for OpenAI-compatible `/v1/chat/completions` endpoints, shared by every judge.

Why its own HTTP: the base install has no async HTTP library, and a judge only ever needs one
request shape (POST a JSON body, read a JSON reply), so a small HTTP/1.1 client over
`asyncio.open_connection` does the job without a thread per request. One connection per request
(`Connection: close`): judge calls last seconds, a TCP handshake is noise beside them. Replies may
come with Content-Length, chunked, or until close; `https` URLs use the default SSL context.

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
import contextlib
import email.utils
import hashlib
import os
import random
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec

from rlmtrain.config import JudgeConfig

__all__ = [
    "ChatClient",
    "ChatStats",
    "HttpResponse",
    "JudgeConfig",
    "Unscored",
    "extract_json_object",
    "post_json",
]

T = TypeVar("T")

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


class HttpResponse(msgspec.Struct, frozen=True):
    status: int
    headers: dict[str, str]
    """Lower-cased header names."""
    body: bytes


class HttpProtocolError(ConnectionError):
    """The server's bytes were not a valid HTTP/1.1 response."""


async def post_json(
    url: str, payload: bytes, headers: dict[str, str], timeout_s: float
) -> HttpResponse:
    """POST `payload` as application/json over HTTP/1.1, the whole exchange within timeout_s."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"post_json: unsupported URL {url!r} (need http:// or https://host)")
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = [
        f"POST {target} HTTP/1.1",
        f"Host: {parts.hostname}:{port}",
        "Content-Type: application/json",
        "Accept: application/json",
        f"Content-Length: {len(payload)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(
            parts.hostname, port, ssl=ssl.create_default_context() if secure else None
        )
        try:
            writer.write(request)
            await writer.drain()
            return await _read_response(reader)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _read_response(reader: asyncio.StreamReader) -> HttpResponse:
    status_line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest.partition(" ")[0]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise HttpProtocolError(f"bad status line {status_line!r}")
    headers: dict[str, str] = {}
    while True:
        line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
        if not line:
            break
        name, colon, value = line.partition(":")
        if not colon:
            raise HttpProtocolError(f"bad header line {line!r}")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    elif "content-length" in headers:
        length = int(headers["content-length"])
        if length > _MAX_BODY_BYTES:
            raise HttpProtocolError(f"body of {length} bytes is over the limit")
        body = await reader.readexactly(length)
    else:
        body = await reader.read(_MAX_BODY_BYTES)
    return HttpResponse(int(code), headers, body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        size_line = (await reader.readline()).split(b";")[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise HttpProtocolError(f"bad chunk size {size_line!r}") from None
        if size == 0:
            while (await reader.readline()).strip():  # trailers
                pass
            return b"".join(chunks)
        total += size
        if total > _MAX_BODY_BYTES:
            raise HttpProtocolError("chunked body over the limit")
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)


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
        self._headers: dict[str, str] = {}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ValueError(
                    f"judge: environment variable {config.api_key_env!r} (judge.api_key_env) "
                    "is not set"
                )
            self._headers["Authorization"] = f"Bearer {key}"
        self.stats = ChatStats()
        self._rng = random.Random(seed)
        self._cache: dict[str, str] = {}
        self._cache_file = Path(config.cache_path) if config.cache_path else None
        if self._cache_file is not None and self._cache_file.exists():
            self._load_cache(self._cache_file)
        self._semaphore: asyncio.Semaphore | None = None
        self._semaphore_loop: asyncio.AbstractEventLoop | None = None

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
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore_loop is not loop:
            # A semaphore belongs to one event loop; a client reused under a new loop
            # (asyncio.run per step, tests) gets a fresh one.
            self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
            self._semaphore_loop = loop
        body = self._request_body(messages)
        last_error = ""
        delay_s = 0.0
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self.stats.retries += 1
                await asyncio.sleep(delay_s)
            try:
                content = await self._attempt(body)
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

    def _request_body(self, messages: list[dict[str, str]]) -> bytes:
        c = self.config
        request: dict[str, Any] = {
            "model": c.model,
            "messages": messages,
            "temperature": c.temperature,
            "max_tokens": c.max_tokens,
        }
        if c.json_mode:
            request["response_format"] = {"type": "json_object"}
        return msgspec.json.encode(request)

    async def _attempt(self, body: bytes) -> str:
        """One HTTP attempt; returns the reply's message content or raises _Retryable/_Fatal."""
        assert self._semaphore is not None
        async with self._semaphore:
            self.stats.requests += 1
            try:
                response = await post_json(self.url, body, self._headers, self.config.timeout_s)
            except TimeoutError:
                self.stats.timeouts += 1
                raise _Retryable(f"timeout after {self.config.timeout_s}s") from None
            except (OSError, asyncio.IncompleteReadError, HttpProtocolError) as exc:
                raise _Retryable(f"connection error: {exc!r}") from None
        status = response.status
        if status == 429 or status >= 500:
            raise _Retryable(
                f"HTTP {status}: {response.body[:200]!r}",
                _retry_after_s(response.headers.get("retry-after")),
            )
        if status != 200:
            raise _Fatal(f"HTTP {status} (not retried): {response.body[:200]!r}")
        try:
            completion = msgspec.json.decode(response.body, type=_Completion)
        except msgspec.DecodeError as exc:
            raise _Retryable(f"malformed completion body: {exc}") from None
        if not completion.choices or not completion.choices[0].message.content:
            raise _Retryable("completion has no message content")
        return completion.choices[0].message.content

    def _backoff(self, attempt: int, retry_after_s: float | None) -> float:
        c = self.config
        delay = min(c.backoff_max_s, c.backoff_base_s * 2.0**attempt) * self._rng.uniform(0.5, 1.0)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, c.backoff_max_s))
        return delay


def _decode(content: str, reply_type: type[T], check: Callable[[T], None] | None) -> T:
    """Decode and validate a reply's JSON object; every failure is a ValueError."""
    try:
        reply = msgspec.json.decode(extract_json_object(content), type=reply_type)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ValueError(str(exc)) from None
    if check is not None:
        check(reply)
    return reply
