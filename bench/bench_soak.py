"""Soak: 200 rollout steps with faults injected, and nothing left behind.

Each step rolls out 4 tasks x 4 roots on the simulated engine with the real scheduler, agent
loop and jailed REPL: a root asks two children with rlm_query_batched and joins their answers.
Faults (`rlmtrain.rollout.faults`): 1% of engine calls raise, 1% of execs lose their worker to
SIGKILL from outside; every root is then scored by the rubric judge against a real HTTP server
on 127.0.0.1 that answers 5% of requests with 503 (the client retries, with backoff). Printed
and stored in `extra_info`: trees by finish reason, faults injected, judge calls scored and
unscored, and the leak figures, which must all stay flat: processes below this one, open
descriptors, REPL temporary directories, SysV IPC objects, REPL memory cgroups (where workers
get them), and this process's resident memory between step 20 (warm) and the end (target:
within 5%).

    python -m pytest bench/bench_soak.py --benchmark-only -s   (about five minutes)
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import random
import re
import tempfile
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import uvloop

from rlmtrain.config import JudgeConfig, RolloutConfig
from rlmtrain.envs.base import Env, Task
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rewards.judge import RubricJudge
from rlmtrain.rlm.memcg import own_memory_cgroup
from rlmtrain.rollout.engines.sim import LatencyModel, SimEngine, text_script
from rlmtrain.rollout.faults import FaultPlan, FaultyEngine, killing_workers
from rlmtrain.rollout.scheduler import Scheduler

STEPS, TASKS, ROOTS = 200, 4, 4
WARM_STEP = 20
PLAN = FaultPlan(engine_error=0.01, worker_kill=0.01, seed=0)
JUDGE_UNAVAILABLE = 0.05
TOKENIZER = ByteTokenizer()


class SoakEnv(Env):
    def system_prompt(self) -> str:
        return "Answer the query; ask helpers with rlm_query_batched."

    def context(self, task: Task) -> Any:
        return {"doc": "the quick brown fox"}

    def tool_modules(self) -> list[str]:
        return ["textwrap"]


def reply(prompt: str) -> str:
    query, turn = re.findall(r"Query: (.*?)\n\nThis is turn (\d+) of", prompt, re.S)[-1]
    if query != "ROOT":
        body = "FINAL('ok')"
    elif turn == "1":
        body = "a = rlm_query_batched(['left', 'right'])\nprint(a)"
    else:
        body = "FINAL('|'.join(a))"
    return f"```python\n{body}\n```\n"


class FlakyJudgeServer:
    """A rubric judge that answers 503 (Retry-After 0) to a seeded share of requests."""

    def __init__(self, unavailable: float, seed: int = 0):
        rng = random.Random(seed)
        self.answered = Counter()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if rng.random() < unavailable:
                    status, body = 503, b"busy"
                else:
                    content = json.dumps({"precision": 9, "recall": 8, "reason": "fine"})
                    status = 200
                    body = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
                server.answered[status] += 1
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                if status == 503:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


LEAK_KEYS = (
    "child_processes",
    "open_fds",
    "repl_temp_dirs",
    "sysv_ipc_objects",
    "memory_cgroups",
    "rss_kb",
)


def leak_figures() -> dict[str, int]:
    """What a rollout may leave behind, counted from /proc and the temporary directory."""
    children = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children += parent == os.getpid()
    ipc = 0
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            ipc += len(f.readlines()) - 1
    with open("/proc/self/status") as f:
        rss_kb = int(re.search(r"VmRSS:\s+(\d+)", f.read())[1])
    return {
        "child_processes": children,
        "open_fds": len(os.listdir("/proc/self/fd")),
        "repl_temp_dirs": len(glob.glob(os.path.join(tempfile.gettempdir(), "rlmtrain-repl-*"))),
        "sysv_ipc_objects": ipc,
        "memory_cgroups": _memory_cgroups(),
        "rss_kb": rss_kb,
    }


def _memory_cgroups() -> int:
    """This process's REPL memory cgroups (pools and workers; 0 where workers get none)."""
    found = own_memory_cgroup()
    if found is None:
        return 0
    pools = glob.glob(str(found[0] / f"rlmtrain-{os.getpid()}-*"))
    return len(pools) + sum(len(glob.glob(os.path.join(pool, "w*"))) for pool in pools)


async def soak(judge_url: str) -> dict[str, Any]:
    engine = SimEngine(
        script=text_script(TOKENIZER, reply),
        eos_id=TOKENIZER.eos_id,
        latency=LatencyModel(a=0.002, b=0.0001),
        max_batch_size=32,
        decode=TOKENIZER.decode,
    )
    faulty = FaultyEngine(engine, PLAN)
    config = RolloutConfig(
        max_turns=3,
        max_depth=1,
        max_new_tokens=128,
        max_prompt_tokens=8192,
        repl_timeout_s=5.0,
        tree_timeout_s=30.0,
    )
    kills: Counter[str] = Counter()
    scheduler = Scheduler(faulty, TOKENIZER, config)
    scheduler.start_zygote = killing_workers(scheduler.start_zygote, PLAN, kills)
    judge = RubricJudge(
        JudgeConfig(base_url=judge_url, max_retries=2, backoff_base_s=0.01, on_unscored="drop")
    )
    env = SoakEnv()
    reasons: Counter[str] = Counter()
    judged: Counter[str] = Counter()
    before = leak_figures()
    warm = before
    for step in range(STEPS):
        tasks = [Task(id=f"s{step}t{i}", query="ROOT") for i in range(TASKS)]
        groups = await scheduler.rollout(tasks, env, ROOTS)
        for group in groups:
            reasons.update(t.finish_reason for t in group.trajectories)
            # One query per root: the judge's cache would otherwise answer all but the first.
            scores = await asyncio.gather(
                *(judge.score(f"query of {root.id}", "ok|ok", root.answer) for root in group.roots)
            )
            judged.update(score.method for score in scores)
        assert set(scheduler.live().values()) == {0}, scheduler.live()
        # The simulated engine's record of every request it saw is kept for tests; it is the
        # stand-in engine's memory, not the trainer's.
        engine.requests_seen.clear()
        if step + 1 == WARM_STEP:
            warm = leak_figures()
        if (step + 1) % 50 == 0:
            print(f"step {step + 1}: {dict(reasons)}  judge {dict(judged)}", flush=True)
    await judge.client.aclose()
    await engine.close()
    after = leak_figures()
    return {
        "finish_reasons": dict(reasons),
        "faults": {**faulty.injected, **kills},
        "judge": dict(judged),
        "before": before,
        "warm": warm,
        "after": after,
        "rss_growth": after["rss_kb"] / warm["rss_kb"] - 1.0,
    }


def test_soak_with_faults(benchmark, tmp_path):
    server = FlakyJudgeServer(JUDGE_UNAVAILABLE)
    result: dict[str, Any] = {}
    # A temporary directory of its own: REPL roots of other runs on the machine do not count.
    saved, tempfile.tempdir = tempfile.tempdir, str(tmp_path)
    # Every injected fault logs a warning, and pytest keeps each record for its report: that
    # would be the harness's memory growing, not the trainer's. The faults are counted instead.
    scheduler_log = logging.getLogger("rlmtrain.rollout")
    level = scheduler_log.level
    scheduler_log.setLevel(logging.ERROR)
    try:
        benchmark.pedantic(
            lambda: result.update(uvloop.run(soak(server.url))), rounds=1, iterations=1
        )
    finally:
        scheduler_log.setLevel(level)
        tempfile.tempdir = saved
        server.close()
    result["judge_server"] = {str(k): v for k, v in server.answered.items()}
    benchmark.extra_info.update(result)
    print(f"\n{STEPS} steps x {TASKS} tasks x {ROOTS} roots")
    print(f"finish reasons     {result['finish_reasons']}")
    print(f"faults injected    {result['faults']}")
    print(f"judge              {result['judge']}  (server answered {result['judge_server']})")
    for key in LEAK_KEYS:
        row = [result[when][key] for when in ("before", "warm", "after")]
        print(f"{key:<18} before {row[0]:>8}  step {WARM_STEP} {row[1]:>8}  end {row[2]:>8}")
    print(
        f"resident memory from step {WARM_STEP} to the end: {result['rss_growth']:+.1%} "
        "(target within 5%)"
    )
