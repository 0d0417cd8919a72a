"""A rank's memory: the pre-flight estimate (its parameter count is the model's own, its parts
move as the knobs say, and a config that cannot fit its card is refused in one line), and the
figures a step row carries.

The measured side on two real ranks is in `tests/test_distributed.py` (the step rows of a
launched run); on a GPU, `bench/gpu/memory_budget.py` measures what the estimate guesses.
"""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

from rlmtrain import memory, parallel
from rlmtrain.config import Config, ConfigError, load_config
from rlmtrain.devices import host_memory
from rlmtrain.model import PRESETS, preset
from rlmtrain.model.transformer import Transformer

GB = 10**9
H100, H200 = 80 * GB, 141 * GB


def _config(**sections) -> Config:
    cfg = Config()
    for name, values in sections.items():
        cfg = msgspec.structs.replace(
            cfg, **{name: msgspec.structs.replace(getattr(cfg, name), **values)}
        )
    return cfg


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_estimates_parameter_count_is_the_models(name):
    args = preset(name)
    with torch.device("meta"):
        model = Transformer(args)
    assert memory._parameters(args) == sum(p.numel() for p in model.parameters())


def test_the_shipped_4b_config_fits_eight_h200s_and_an_8b_model_does_not_fit_one_h100():
    shipped = load_config("configs/qwen3-4b-8xh200.toml")
    fits = memory.estimate(shipped, preset("qwen3-4b"), 8, H200)
    assert fits.peak < 0.9 * H200
    # 8B parameters x 16 bytes of fp32 states on one card: 128 GB before anything else.
    alone = _config(
        model={"preset": "qwen3-8b", "dtype": "bfloat16", "activation_checkpointing": True},
        rollout={"engine": "vllm", "colocate": True},
    )
    guess = memory.estimate(alone, preset("qwen3-8b"), 1, H100)
    assert guess.states > H100
    assert memory.estimate(alone, preset("qwen3-8b"), 8, H100).peak < H100  # sharded it fits


def test_each_knob_moves_its_own_part():
    args = preset("qwen3-4b")
    base = _config(
        model={"dtype": "bfloat16"},
        rollout={"engine": "vllm", "colocate": True, "gpu_memory_utilization": 0.5},
        algo={"micro_batch_tokens": 32768},
    )
    one = memory.estimate(base, args, 8, H200)
    more_ranks = memory.estimate(base, args, 16, H200)
    assert more_ranks.states * 2 == pytest.approx(one.states, rel=1e-6)
    hsdp = memory.estimate(
        _config(**{**_sections(base), "parallel": {"replicate": 2}}), args, 16, H200
    )
    assert hsdp.states == one.states  # two replicas of 8 shards: a rank holds what 8 ranks hold
    checkpointed = memory.estimate(
        _config(
            **{**_sections(base), "model": {"dtype": "bfloat16", "activation_checkpointing": True}}
        ),
        args,
        8,
        H200,
    )
    assert checkpointed.activations < one.activations / 5
    apart = memory.estimate(
        _config(**{**_sections(base), "rollout": {"engine": "vllm", "colocate": False}}),
        args,
        8,
        H200,
    )
    assert apart.peak == apart.training + apart.engine
    assert one.peak == max(one.training, one.states + one.engine)
    with_kl = memory.estimate(
        _config(**{**_sections(base), "algo": {"micro_batch_tokens": 32768, "kl_beta": 0.05}}),
        args,
        8,
        H200,
    )
    assert with_kl.reference == one.states // 4 and with_kl.peak > one.peak


def _sections(cfg: Config) -> dict:
    return {
        name: msgspec.structs.asdict(getattr(cfg, name)) for name in ("model", "rollout", "algo")
    }


def test_a_run_that_cannot_fit_its_card_is_refused_in_one_line(monkeypatch):
    class Card:
        total_memory = H100

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Card)
    cfg = _config(
        model={"preset": "qwen3-8b", "dtype": "bfloat16", "activation_checkpointing": True},
        rollout={"engine": "vllm", "colocate": True},
    )
    with pytest.raises(ConfigError) as refused:
        memory.check_fits(cfg, preset("qwen3-8b"), 1, torch.device("cuda", 0))
    message = str(refused.value)
    assert message.startswith("memory: this run needs ~")
    assert "model states 122.1" in message and "on a 75 GiB card" in message
    assert "\n" not in message
    memory.check_fits(cfg, preset("qwen3-8b"), 8, torch.device("cuda", 0))  # 8 ranks fit


def test_a_cpu_run_is_refused_only_past_all_of_its_hosts_memory(monkeypatch):
    cfg = _config(model={"preset": "qwen3-8b", "dtype": "bfloat16"})
    cpu = torch.device("cpu")
    needs = memory.estimate(cfg, preset("qwen3-8b"), 1, 0).peak
    monkeypatch.setattr(memory, "host_memory", lambda: int(needs * 1.5))
    memory.check_fits(cfg, preset("qwen3-8b"), 1, cpu)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks of it on the host: past it
    with pytest.raises(ConfigError, match=r"^memory: this run needs ~.*, 2 rank\(s\) on a host"):
        memory.check_fits(cfg, preset("qwen3-8b"), 1, cpu)
    monkeypatch.setattr(memory, "host_memory", lambda: 0)  # a kernel that does not say
    memory.check_fits(cfg, preset("qwen3-8b"), 1, cpu)


def test_the_hosts_memory_is_read():
    assert host_memory() >= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_step_row_carries_every_ranks_figures_and_their_maximum():
    marks = {"rollout": memory.figures(torch.device("cpu"))}
    marks["train"] = memory.figures(torch.device("cpu"))
    assert (
        marks["rollout"]["resident"] > 0.01 and marks["train"]["peak"] >= marks["train"]["resident"]
    )
    parallel.start("cpu")
    try:
        row = memory.step_row(marks)
    finally:
        parallel.stop()
    assert row["memory_gib_ranks"]["train_peak"] == [marks["train"]["peak"]]
    assert row["memory_gib"]["rollout_resident"] == marks["rollout"]["resident"]


def test_optimizer_offload_moves_adamws_moments_off_the_card():
    args = preset("qwen3-4b")
    sections = {
        "model": {"dtype": "bfloat16", "activation_checkpointing": True},
        "rollout": {"engine": "vllm", "colocate": True, "gpu_memory_utilization": 0.5},
    }
    on_card = memory.estimate(_config(**sections), args, 1, H100)
    offloaded = memory.estimate(
        _config(**sections, train={"optimizer_offload": True}), args, 1, H100
    )
    assert on_card.host == 0
    assert offloaded.host == on_card.states // 2  # the two moments, 8 of 16 bytes a parameter
    assert offloaded.states == on_card.states - offloaded.host
    assert offloaded.optimizer_step < on_card.optimizer_step
    # Qwen3-4B on one H100 beside a colocated engine at half the card: only offloaded.
    assert on_card.peak > 0.95 * H100 > offloaded.peak
    assert "AdamW moments in host memory" in offloaded.describe()
