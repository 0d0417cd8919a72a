"""RubricJudge and its chat client against a real HTTP server on 127.0.0.1.

The server reads a `case:<name>` marker from the query and plays that case: a good reply, a
malformed one, a slow one, a 429 or 503 with Retry-After, a 500, a 400, a body chunked, sent
without a length until close, trickled, cut short, a reset connection, a body that is not JSON.
It records every request it sees, so retries and cache hits are asserted by counting what
reached it.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlmtrain.config import ConfigError
from rlmtrain.rewards.chat_client import ChatClient, JudgeConfig, Unscored, check_served
from rlmtrain.rewards.judge import RubricJudge, RubricReply
from rlmtrain.rewards.span_f1 import span_f1

GOOD = {"precision": 8, "recall": 6, "reason": "mostly right"}
GOOD_SCORE = (8 - 1 + 6 - 1) / 18


class JudgeServer:
    """A scripted OpenAI-compatible endpoint; `seen[case]` lists arrival times per case."""

    def __init__(self):
        self.seen: dict[str, list[float]] = defaultdict(list)
        self.cases: dict[str, Callable[[int], tuple[int, bytes]]] = {}
        """Extra cases: name -> f(nth request) -> (status, body)."""
        self.handlers: dict[str, Callable[[int, dict], tuple[int, bytes]]] = {}
        """Extra cases that read the request: name -> f(nth, request json) -> (status, body)."""
        self.bodies: list[dict] = []
        self.models: list[str] | None = None
        """What GET /v1/models lists; None = 404, as a server without the listing answers."""
        self.retry_arrived = threading.Event()
        """Set by `slow_once`'s second request (and at exit): its first is held until then."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                if server.models is None or self.path != "/v1/models":
                    return server.reply(self, 404, b'{"error": "not found"}')
                listing = {"object": "list", "data": [{"id": m} for m in server.models]}
                server.reply(self, 200, json.dumps(listing).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append({"path": self.path, "auth": self.headers.get("Authorization")})
                text = body["messages"][-1]["content"]
                case = re.search(r"case:(\w+)", text).group(1)
                server.seen[case].append(time.monotonic())
                server.play(self, case, len(server.seen[case]), body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> JudgeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.retry_arrived.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def count(self, case: str) -> int:
        return len(self.seen[case])

    def play(self, handler: BaseHTTPRequestHandler, case: str, nth: int, body: dict) -> None:
        if case in self.handlers:
            return self.reply(handler, *self.handlers[case](nth, body))
        if case in self.cases:
            return self.reply(handler, *self.cases[case](nth))
        if case == "good":
            return self.reply(handler, 200, completion(json.dumps(GOOD)))
        if case == "fenced":
            return self.reply(handler, 200, completion(f"Sure:\n```json\n{json.dumps(GOOD)}\n```"))
        if case == "malformed_once":
            content = "I think it is good" if nth == 1 else json.dumps(GOOD)
            return self.reply(handler, 200, completion(content))
        if case == "out_of_range":
            return self.reply(handler, 200, completion('{"precision": 11, "recall": 3}'))
        if case == "slow_once":
            # The first request is answered only once the retry has arrived, so it times out
            # whatever the machine's load; the retry is answered at once.
            if nth == 1:
                self.retry_arrived.wait()
            else:
                self.retry_arrived.set()
            return self.reply(handler, 200, completion(json.dumps(GOOD)))
        if case == "throttled_once":
            if nth == 1:
                return self.reply(handler, 429, b'{"error": "slow down"}', {"Retry-After": "1"})
            return self.reply(handler, 200, completion(json.dumps(GOOD)))
        if case == "error_once":
            if nth == 1:
                return self.reply(handler, 500, b'{"error": "boom"}')
            return self.reply(handler, 200, completion(json.dumps(GOOD)))
        if case == "error_always":
            return self.reply(handler, 500, b'{"error": "boom"}')
        if case == "bad_request":
            return self.reply(handler, 400, b'{"error": "bad model"}')
        if case == "chunked":
            return self.reply_chunked(handler, completion(json.dumps(GOOD)))
        if case == "until_close":  # no Content-Length, not chunked: the body ends at close
            return self.reply_until_close(handler, completion(json.dumps(GOOD), pad=5000))
        if case == "trickled":
            return self.reply_until_close(handler, completion(json.dumps(GOOD)), pause_s=0.02)
        if case == "cut_off_once":
            if nth == 1:
                payload = completion(json.dumps(GOOD))
                return self.reply_cut_off(handler, payload)
            return self.reply(handler, 200, completion(json.dumps(GOOD)))
        if case == "reset_once":
            if nth == 1:
                return self.reset(handler)
            return self.reply(handler, 200, completion(json.dumps(GOOD)))
        if case == "not_json_once":
            if nth == 1:
                return self.reply(handler, 200, b"<html>gateway hiccup</html>")
            return self.reply(handler, 200, completion(json.dumps(GOOD)))
        if case == "unavailable_once":
            if nth == 1:
                return self.reply(handler, 503, b"busy", {"Retry-After": "1"})
            return self.reply(handler, 200, completion(json.dumps(GOOD)))
        raise AssertionError(f"unknown case {case}")

    @staticmethod
    def reply_until_close(handler, payload: bytes, pause_s: float = 0.0) -> None:
        handler.close_connection = True
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.flush()
        for i in range(0, len(payload), 100):
            handler.wfile.write(payload[i : i + 100])
            handler.wfile.flush()
            time.sleep(pause_s or 0.001)

    @staticmethod
    def reply_cut_off(handler, payload: bytes) -> None:
        handler.close_connection = True
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload[: len(payload) // 2])
        handler.wfile.flush()

    @staticmethod
    def reset(handler) -> None:
        import socket
        import struct

        handler.close_connection = True
        # SO_LINGER 0: close() sends RST instead of FIN.
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.connection.close()

    @staticmethod
    def reply(handler, status: int, payload: bytes, headers: dict | None = None) -> None:
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            for k, v in (headers or {}).items():
                handler.send_header(k, v)
            handler.end_headers()
            handler.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out and left

    @staticmethod
    def reply_chunked(handler, payload: bytes) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for i in range(0, len(payload), 7):
            piece = payload[i : i + 7]
            handler.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        handler.wfile.write(b"0\r\n\r\n")


def completion(content: str, pad: int = 0) -> bytes:
    """A chat completion; `pad` characters of an extra field make the body that much longer."""
    body = {"choices": [{"index": 0, "message": {"content": content}}]}
    if pad:
        body["system_fingerprint"] = "x" * pad
    return json.dumps(body).encode()


@pytest.fixture
def server():
    with JudgeServer() as s:
        yield s


def make_judge(server: JudgeServer, **overrides) -> RubricJudge:
    settings = dict(
        base_url=server.url,
        model="test-judge",
        # Generous: a reply on the loopback must never miss it on a loaded machine. The one
        # test of the timeout path forces it with a request that is held unanswered.
        timeout_s=30.0,
        max_retries=2,
        backoff_base_s=0.01,
        backoff_max_s=2.0,
    )
    settings.update(overrides)
    return RubricJudge(JudgeConfig(**settings))


def run(coro):
    return asyncio.run(coro)


TRUTH = "the mitochondria is the powerhouse of the cell"


def test_good_reply_is_scored_from_the_rubric(server):
    judge = make_judge(server)
    result = run(judge.score("case:good what powers the cell?", TRUTH, "mitochondria"))
    assert result.method == "judge"
    assert result.score == pytest.approx(GOOD_SCORE)
    assert (result.precision, result.recall, result.reason) == (8, 6, "mostly right")
    assert server.count("good") == 1
    assert server.bodies[0]["path"] == "/v1/chat/completions"
    assert judge.client.stats.requests == 1 and judge.client.stats.retries == 0


def test_reply_inside_code_fence_and_chunked_body_are_read(server):
    judge = make_judge(server)
    fenced = run(judge.score("case:fenced q", TRUTH, "x"))
    chunked = run(judge.score("case:chunked q", TRUTH, "x"))
    assert fenced.score == pytest.approx(GOOD_SCORE)
    assert chunked.score == pytest.approx(GOOD_SCORE)


def test_repeat_is_a_cache_hit_without_a_request(server):
    judge = make_judge(server)
    first = run(judge.score("case:good q", TRUTH, "mitochondria"))
    second = run(judge.score("case:good q", TRUTH, "mitochondria"))
    other = run(judge.score("case:good q", TRUTH, "ribosome"))
    assert first == second and other.score == pytest.approx(GOOD_SCORE)
    assert server.count("good") == 2
    assert judge.client.stats.cache_hits == 1


def test_disk_cache_survives_a_new_client(server, tmp_path):
    path = tmp_path / "not-yet" / "judge_cache.jsonl"  # its folder is made on the first reply
    run(make_judge(server, cache_path=str(path)).score("case:good q", TRUTH, "p"))
    again = make_judge(server, cache_path=str(path))
    result = run(again.score("case:good q", TRUTH, "p"))
    assert result.score == pytest.approx(GOOD_SCORE)
    assert server.count("good") == 1
    assert again.client.stats.cache_hits == 1 and again.client.stats.requests == 0
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=r"judge_cache.jsonl:1"):
        make_judge(server, cache_path=str(path))


def test_malformed_reply_is_retried(server):
    judge = make_judge(server)
    result = run(judge.score("case:malformed_once q", TRUTH, "p"))
    assert result.method == "judge" and result.score == pytest.approx(GOOD_SCORE)
    assert server.count("malformed_once") == 2
    assert judge.client.stats.retries == 1


def test_out_of_range_reply_exhausts_retries_then_falls_back_to_span_f1(server):
    judge = make_judge(server)
    prediction = "mitochondria is the powerhouse"
    result = run(judge.score("case:out_of_range q", TRUTH, prediction))
    assert server.count("out_of_range") == 3  # 1 + max_retries
    assert result.method == "span_f1"
    assert result.score == pytest.approx(span_f1(prediction, TRUTH))
    assert "precision" in result.reason  # msgspec's message names the bad field
    stats = judge.client.stats
    assert (stats.requests, stats.retries, stats.failures) == (3, 2, 1)


def test_slow_reply_times_out_and_is_retried(server):
    # The first attempt cannot be answered before its timeout; the short timeout only bounds
    # how long the test waits for it, and the retry is answered at once.
    judge = make_judge(server, timeout_s=3.0)
    result = run(judge.score("case:slow_once q", TRUTH, "p"))
    assert result.method == "judge"
    assert server.count("slow_once") == 2
    assert judge.client.stats.timeouts == 1 and judge.client.stats.retries == 1


def test_429_waits_for_retry_after(server):
    judge = make_judge(server)
    result = run(judge.score("case:throttled_once q", TRUTH, "p"))
    assert result.method == "judge"
    first, second = server.seen["throttled_once"]
    # The backoff alone would be ~0.01 s; the server asked for 1 s.
    assert second - first >= 0.9


def test_500_is_retried(server):
    judge = make_judge(server)
    assert run(judge.score("case:error_once q", TRUTH, "p")).method == "judge"
    assert server.count("error_once") == 2


def test_persistent_500_is_dropped_when_configured(server):
    judge = make_judge(server, on_unscored="drop", max_retries=1)
    result = run(judge.score("case:error_always q", TRUTH, "p"))
    assert result.score is None and result.method == "unscored"
    assert "HTTP 500" in result.reason and "2 attempts" in result.reason
    assert server.count("error_always") == 2


def test_400_is_not_retried(server):
    judge = make_judge(server, on_unscored="drop", response_format="json_object")
    result = run(judge.score("case:bad_request q", TRUTH, "p"))
    assert result.score is None and "HTTP 400" in result.reason
    assert server.count("bad_request") == 1
    # Asked with a schema, a 400 is first taken for a server without structured output.
    schema_judge = make_judge(server, on_unscored="drop")
    result = run(schema_judge.score("case:bad_request q", TRUTH, "p"))
    assert result.score is None and "HTTP 400" in result.reason
    assert server.count("bad_request") == 3


def test_503_waits_for_retry_after(server):
    judge = make_judge(server)
    assert run(judge.score("case:unavailable_once q", TRUTH, "p")).method == "judge"
    first, second = server.seen["unavailable_once"]
    assert second - first >= 0.9


def test_missing_answer_is_zero_without_a_request(server):
    judge = make_judge(server)
    result = run(judge.score("case:good q", TRUTH, None))
    assert (result.score, result.method) == (0.0, "no_answer")
    assert server.count("good") == 0


def test_score_many_bounds_concurrency(server):
    judge = make_judge(server, max_concurrency=2)
    predictions = [f"answer {i}" for i in range(6)] + [None]
    results = run(judge.score_many("case:good q", TRUTH, predictions))
    assert [r.method for r in results] == ["judge"] * 6 + ["no_answer"]
    assert server.count("good") == 6


def test_api_key_from_named_env_var(server, monkeypatch):
    monkeypatch.setenv("RLMTRAIN_TEST_JUDGE_KEY", "sekret")
    judge = make_judge(server, api_key_env="RLMTRAIN_TEST_JUDGE_KEY")
    run(judge.score("case:good q", TRUTH, "p"))
    assert server.bodies[-1]["auth"] == "Bearer sekret"
    monkeypatch.delenv("RLMTRAIN_TEST_JUDGE_KEY")
    with pytest.raises(ValueError, match="RLMTRAIN_TEST_JUDGE_KEY"):
        make_judge(server, api_key_env="RLMTRAIN_TEST_JUDGE_KEY")


def test_unreachable_server_is_unscored(server):
    port = server.httpd.server_address[1]
    server.__exit__()
    client = ChatClient(
        JudgeConfig(base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, backoff_base_s=0.01)
    )
    reply = run(client.complete_json([{"role": "user", "content": "x"}], RubricReply))
    assert isinstance(reply, Unscored) and "connection error" in reply.reason


def test_bad_base_url_fails_at_construction():
    with pytest.raises(ValueError, match="judge.base_url must be"):
        ChatClient(JudgeConfig(base_url="localhost:8000/v1"))


@pytest.mark.parametrize("case", ["until_close", "trickled"])
def test_a_body_without_a_length_is_read_to_its_end(server, case):
    judge = make_judge(server)
    result = run(judge.score(f"case:{case} q", TRUTH, "p"))
    assert result.method == "judge" and result.score == pytest.approx(GOOD_SCORE)
    assert result.reason == GOOD["reason"]
    assert server.count(case) == 1


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("cut_off_once", "connection error"),
        ("reset_once", "connection error"),
        ("not_json_once", "malformed"),
        ("unavailable_once", "HTTP 503"),
    ],
)
def test_a_failed_attempt_is_retried_and_then_scored(case, reason):
    with JudgeServer() as server:
        judge = make_judge(server, on_unscored="drop", max_retries=0)
        failed = run(judge.score(f"case:{case} q", TRUTH, "p"))
        assert failed.method == "unscored" and reason in failed.reason, failed.reason
    with JudgeServer() as server:  # its first reply fails again; the retry is scored
        retried = make_judge(server)
        result = run(retried.score(f"case:{case} q", TRUTH, "p"))
        assert result.method == "judge" and result.score == pytest.approx(GOOD_SCORE)
        assert retried.client.stats.retries == 1 and server.count(case) == 2


def test_connections_are_kept_alive_across_calls(server):
    judge = make_judge(server, max_concurrency=2)
    predictions = [f"answer {i}" for i in range(8)]

    async def both():
        await judge.score_many("case:good q", TRUTH, predictions[:4])
        await judge.score_many("case:good q", TRUTH, predictions[4:])
        await judge.client.aclose()

    run(both())
    stats = judge.client.stats
    assert stats.requests == 8 and 1 <= stats.connections <= 2, stats


def test_the_reply_schema_is_sent_and_a_refusal_falls_back_to_json_object(server):
    formats = []

    def picky(nth, body):
        formats.append(body.get("response_format", {}).get("type"))
        if formats[-1] == "json_schema":
            return 400, b'{"error": "response_format json_schema is not supported"}'
        return 200, completion(json.dumps(GOOD))

    server.handlers["picky"] = picky
    judge = make_judge(server)
    assert run(judge.score("case:picky q", TRUTH, "p")).method == "judge"
    assert run(judge.score("case:picky other", TRUTH, "p")).method == "judge"
    assert formats == ["json_schema", "json_object", "json_object"]

    schemas = []

    def record(nth, body):
        schemas.append(body["response_format"])
        return 200, completion(json.dumps(GOOD))

    server.handlers["schema"] = record
    run(make_judge(server).score("case:schema q", TRUTH, "p"))
    [sent] = schemas
    schema = sent["json_schema"]["schema"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["name"] == "RubricReply"
    assert schema["type"] == "object" and schema["required"] == ["precision", "recall"]
    assert schema["properties"]["precision"] == {"type": "integer", "minimum": 1, "maximum": 10}


def test_a_raw_newline_inside_the_reason_is_read(server):
    raw = '{"precision": 8, "recall": 6, "reason": "mostly\nright\tenough"}'
    server.cases["raw_newline"] = lambda nth: (200, completion(raw))
    result = run(make_judge(server).score("case:raw_newline q", TRUTH, "p"))
    assert result.method == "judge" and result.reason == "mostly\nright\tenough"


def test_a_reply_nested_too_deeply_is_malformed_not_a_crash(server):
    deep = '{"precision": 3, "recall": 4, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    server.cases["deep"] = lambda nth: (200, completion(deep if nth == 1 else json.dumps(GOOD)))
    result = run(make_judge(server).score("case:deep q", TRUTH, "p"))
    assert result.method == "judge" and server.count("deep") == 2


def test_a_run_checks_its_judge_is_served_before_leaning_on_it(server):
    config = JudgeConfig(base_url=server.url, model="test-judge")
    check_served(config)  # no listing (404): taken at its word
    server.models = ["test-judge", "other"]
    check_served(config)
    server.models = ["other"]
    with pytest.raises(ConfigError, match=r"judge\.model: 'test-judge' is not served .*'other'"):
        check_served(config)
    server.__exit__()
    with pytest.raises(ConfigError, match=r"judge\.base_url: nothing answers at .*Serving a judge"):
        check_served(config, timeout_s=2.0)


@pytest.mark.parametrize("url", ["http://[::1", "http://host:port/v1"])
def test_a_judge_url_that_is_no_url_is_named(url):
    with pytest.raises(ConfigError, match=r"judge\.base_url: '.*' is not a URL"):
        check_served(JudgeConfig(base_url=url, model="m"), timeout_s=2.0)
