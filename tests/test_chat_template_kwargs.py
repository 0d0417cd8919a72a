"""`rollout.chat_template_kwargs`: extra chat-template variables at every render.

Qwen3's template thinks unless told not to; `{enable_thinking = false}` writes an empty think
block after the generation prompt. Checked here: our rendering with and without it against
transformers' on a Qwen3-shaped template, the refusals (no Jinja template, a name the renderer
sets itself, a name the template never reads), and that the kwargs reach what the engine is
sent on a rollout turn and the SFT samples built from the teacher's trees, alike.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from scheduler_harness import reply_of, run
from scripted_model import DocEnv, code
from test_tokenizer import CONVERSATIONS, _save, _train_bpe
from tokenizers import AddedToken

from rlmtrain.algo import build_sft_samples
from rlmtrain.config import AlgoConfig, ConfigError, RolloutConfig, load_config
from rlmtrain.envs.base import Task
from rlmtrain.envs.teacher import plan_reply
from rlmtrain.model.bpe import train_bpe
from rlmtrain.model.hf_tokenizer import HFTokenizer
from rlmtrain.model.tokenizer import ByteTokenizer, with_chat_template_kwargs
from rlmtrain.rollout.engine import SamplingParams
from rlmtrain.rollout.engines.sim import LatencyModel, SimEngine, text_script
from rlmtrain.rollout.scheduler import Scheduler
from rlmtrain.rollout.teaching import teach

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

# Qwen3's shape in brief: ChatML turns, and a generation prompt that leaves the model to think
# unless `enable_thinking` is false, in which case the think block comes pre-closed and empty.
QWEN3_STYLE_TEMPLATE = """\
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('this template has no role ' + message.role) }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

NO_THINKING = {"enable_thinking": False}
EMPTY_THINK = "<think>\n\n</think>\n\n"
PLAIN = ["user_only", "multi_turn", "unicode"]  # no control-token strings in the messages


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    bpe = _train_bpe()
    # Added but not special, as in Qwen3's tokenizer.json.
    bpe.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    return _save(
        bpe,
        tmp_path_factory.mktemp("qwen3_style"),
        QWEN3_STYLE_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


@pytest.fixture(scope="module")
def ours(qwen3_dir) -> HFTokenizer:
    return HFTokenizer.from_dir(qwen3_dir)


@pytest.fixture(scope="module")
def theirs(qwen3_dir):
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))


def _think_ids(tokenizer: HFTokenizer) -> list[int]:
    return tokenizer.encode(EMPTY_THINK, allow_special=True)


# ---------------------------------------------------------------------------------------------
# the render against transformers'
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [{}, NO_THINKING, {"enable_thinking": True}], ids=["default", "off", "on"]
)
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("name", PLAIN)
def test_render_matches_transformers(ours, theirs, name, add_generation_prompt, kwargs):
    messages = CONVERSATIONS[name]
    bound = with_chat_template_kwargs(ours, kwargs)
    expected_text = theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    expected_ids = theirs.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    text = bound.render_chat(messages, add_generation_prompt)
    ids = bound.apply_chat_template(messages, add_generation_prompt)
    assert text == expected_text
    assert ids == list(expected_ids)
    thinking_off = add_generation_prompt and kwargs == NO_THINKING
    assert text.endswith("<|im_start|>assistant\n" + EMPTY_THINK) == thinking_off
    # The block's tags are the added tokens, not their characters.
    assert (ids[-len(_think_ids(ours)) :] == _think_ids(ours)) == thinking_off
    assert ours.token_to_id("<think>") in _think_ids(ours)


def test_binding_makes_a_copy_and_replaces_what_was_bound(ours):
    messages = CONVERSATIONS["user_only"]
    bound = with_chat_template_kwargs(ours, NO_THINKING)
    assert bound.template_kwargs == NO_THINKING and ours.template_kwargs == {}
    assert EMPTY_THINK not in ours.render_chat(messages, add_generation_prompt=True)
    assert EMPTY_THINK in bound.render_chat(messages, add_generation_prompt=True)
    unbound = with_chat_template_kwargs(bound, {})
    assert unbound.render_chat(messages, True) == ours.render_chat(messages, True)


# ---------------------------------------------------------------------------------------------
# refusals: one line naming the key
# ---------------------------------------------------------------------------------------------


def _refusal(tokenizer, kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        with_chat_template_kwargs(tokenizer, kwargs)
    message = str(caught.value)
    assert message.startswith("rollout.chat_template_kwargs: ") and "\n" not in message
    return message


def test_tokenizers_without_a_template_that_reads_them_refuse(ours, tmp_path):
    assert "ByteTokenizer writes a fixed ChatML format" in _refusal(ByteTokenizer(), NO_THINKING)
    # The BPE a run trains renders ChatML through a template that reads no extra variable.
    bpe = train_bpe(["the quick brown fox jumps over the lazy dog"] * 4, 300, tmp_path / "bpe")
    assert "never reads 'enable_thinking'" in _refusal(bpe, NO_THINKING)
    templateless = HFTokenizer(
        _train_bpe(), special_tokens={"eos_token": "<|im_end|>"}, chat_template=None
    )
    assert "has no chat template" in _refusal(templateless, NO_THINKING)
    assert "never reads 'enable_thinkng'" in _refusal(ours, {"enable_thinkng": False})
    # Nothing to refuse when nothing is asked.
    byte = ByteTokenizer()
    assert with_chat_template_kwargs(byte, {}) is byte
    assert with_chat_template_kwargs(templateless, {}).template_kwargs == {}


@pytest.mark.parametrize(
    "name", ["messages", "add_generation_prompt", "tools", "documents", "eos_token", "namespace"]
)
def test_names_the_renderer_sets_itself_are_refused(ours, name):
    message = _refusal(ours, {name: "x", "enable_thinking": False})
    assert f"'{name}': the renderer sets that template variable itself" in message


def test_the_scheduler_refuses_a_tokenizer_that_cannot_use_them():
    tokenizer = ByteTokenizer()
    engine = SimEngine(script=lambda ids, params: [], eos_id=tokenizer.eos_id)
    with pytest.raises(ConfigError, match="rollout.chat_template_kwargs"):
        Scheduler(engine, tokenizer, RolloutConfig(chat_template_kwargs=NO_THINKING))


def test_the_qwen3_config_turns_thinking_off():
    for path in sorted((ROOT / "configs").glob("qwen3-*.toml")):
        assert load_config(path).rollout.chat_template_kwargs == NO_THINKING, path.name


# ---------------------------------------------------------------------------------------------
# the kwargs reach the engine: rollout turns and the SFT samples
# ---------------------------------------------------------------------------------------------

LIMITS = {
    "max_turns": 3,
    "max_depth": 0,
    "max_new_tokens": 256,
    "max_prompt_tokens": 16384,
    "repl_timeout_s": 30.0,
    "tree_timeout_s": 60.0,
}


def _two_turns(query: str, turn: int) -> str:
    return code("n = len(context['doc'])") if turn == 0 else code("FINAL(str(n))")


def _rollout_prompts(tokenizer, kwargs, tmp_path) -> tuple[list[list[int]], list[list[int]]]:
    """The prompt ids of the root's turns and the prompts the engine was sent."""
    engine = SimEngine(
        script=text_script(tokenizer, reply_of(_two_turns)),
        eos_id=tokenizer.eos_id,
        latency=LatencyModel(a=0.001),
        max_batch_size=4,
        decode=tokenizer.decode,
    )
    config = RolloutConfig(**LIMITS, chat_template_kwargs=kwargs)
    (group,) = run(Scheduler(engine, tokenizer, config), engine, tmp_path)
    (root,) = group.trajectories
    assert root.finish_reason == "final" and root.answer == "19"
    return [turn.prompt_ids for turn in root.turns], [ids for ids, _ in engine.requests_seen]


def test_rollout_turns_send_the_engine_the_bound_render(ours, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "off").mkdir()
    plain, _ = _rollout_prompts(ours, {}, tmp_path / "plain")
    turns, sent = _rollout_prompts(ours, NO_THINKING, tmp_path / "off")
    assert len(turns) == len(plain) == 2
    assert sent == turns, "the engine gets the turn's prompt ids, as rendered"
    for with_kwargs, without in zip(turns, plain, strict=True):
        # The chat is the same; only the generation prompt gains the empty think block.
        assert with_kwargs == without + _think_ids(ours)
        assert ours.decode(with_kwargs).endswith("<|im_start|>assistant\n" + EMPTY_THINK)


class TaughtDocEnv(DocEnv):
    """DocEnv with a scripted teacher: two turns, as `_two_turns` plays them."""

    def teacher(self, rollout: RolloutConfig):
        return plan_reply(lambda query: ["n = len(context['doc'])", "FINAL(str(n))"], "doc teacher")


def test_sft_samples_and_rollouts_render_alike(ours, tmp_path):
    env, tasks = TaughtDocEnv(), [Task(id="t0", query="How long is the document?")]
    config = RolloutConfig(**LIMITS, chat_template_kwargs=NO_THINKING)
    groups = asyncio.run(teach(env, tasks, ours, config))
    samples, stats = build_sft_samples(groups, lambda root, task: 1.0, AlgoConfig())
    assert stats.kept == 1 and len(samples) == 2
    sft_prompts = [
        s.input_ids[: s.prompt_len].tolist() for s in sorted(samples, key=lambda s: s.turn)
    ]

    # The RL path: the policy (here answering as the teacher does) sampled by the scheduler.
    engine = SimEngine(
        script=text_script(ours, env.teacher(config)),
        eos_id=ours.eos_id,
        decode=ours.decode,
    )
    scheduler = Scheduler(engine, ours, config, sampling=SamplingParams(temperature=1.0))

    async def rollout():
        try:
            return await scheduler.rollout(tasks, env, 2)
        finally:
            await engine.close()

    (group,) = asyncio.run(rollout())
    for root in group.roots:
        assert [turn.prompt_ids for turn in root.turns] == sft_prompts
    for prompt in sft_prompts:
        assert prompt[-len(_think_ids(ours)) :] == _think_ids(ours)
