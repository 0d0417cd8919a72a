"""The LR schedule: a pure function of phase and step, each phase over its own steps; AdamW
with its moments in host memory (`train.optimizer_offload`)."""

import copy
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlmtrain.config import load_config
from rlmtrain.optim import HostAdamW, build_optimizer, lr_at
from rlmtrain.resume import _rl_length_free


def _config(**train):
    """The default's config with the schedule keys set here, not inherited from it."""
    keys = {"sft_lr": 3e-3, "lr": 3e-4, "lr_schedule": "constant", "sft_lr_schedule": "same"}
    keys |= {"min_lr_ratio": 0.0, "warmup_steps": 0} | train
    overrides = [f"--train.{key}={value}" for key, value in keys.items()]
    return load_config("configs/tiny-cpu.toml", overrides)


def test_constant_holds_each_phase_at_its_own_peak():
    cfg = _config(sft_steps=10, steps=5, sft_lr=3e-3, lr=3e-4)
    assert [lr_at(cfg, "sft", s) for s in (0, 9)] == [3e-3, 3e-3]
    assert [lr_at(cfg, "rl", s) for s in (0, 4)] == [3e-4, 3e-4]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_reaches_the_floor_at_the_phase_last_step(schedule):
    cfg = _config(sft_steps=11, steps=5, lr_schedule=schedule, min_lr_ratio=0.1, warmup_steps=2)
    sft_lrs = [lr_at(cfg, "sft", s) for s in range(11)]
    assert sft_lrs[0] == pytest.approx(3e-3 / 3) and sft_lrs[1] == pytest.approx(2 * 3e-3 / 3)
    assert sft_lrs[2] == pytest.approx(3e-3) and sft_lrs[-1] == pytest.approx(3e-4)
    assert all(a >= b for a, b in zip(sft_lrs[2:-1], sft_lrs[3:], strict=True))
    # halfway through the 8-step decay both schedules stand midway between peak and floor
    assert sft_lrs[2 + 4] == pytest.approx((3e-3 + 3e-4) / 2)
    quarter = sft_lrs[2 + 2]
    linear_quarter, cosine_quarter = (
        3e-3 - 0.25 * 2.7e-3,
        3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi / 4)),
    )
    assert quarter == pytest.approx(linear_quarter if schedule == "linear" else cosine_quarter)
    assert lr_at(cfg, "rl", 4) == pytest.approx(3e-5)


def test_sft_lr_schedule_decays_sft_alone():
    """The default's use: SFT settles on a cosine while RL holds its LR."""
    cfg = _config(sft_steps=9, steps=5, sft_lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(cfg, "sft", 0) == pytest.approx(3e-3)
    assert lr_at(cfg, "sft", 4) == pytest.approx(0.55 * 3e-3)
    assert lr_at(cfg, "sft", 8) == pytest.approx(3e-4)
    assert [lr_at(cfg, "rl", s) for s in range(5)] == [3e-4] * 5


def test_sft_warmup_steps_gives_sft_its_own_warmup():
    """RL ramps up over warmup_steps while SFT starts at its peak; -1 follows warmup_steps."""
    cfg = _config(sft_steps=9, steps=5, warmup_steps=3, sft_warmup_steps=0)
    assert lr_at(cfg, "sft", 0) == 3e-3
    assert [lr_at(cfg, "rl", s) for s in range(4)] == pytest.approx([7.5e-5, 1.5e-4, 2.25e-4, 3e-4])
    same = _config(sft_steps=9, steps=5, warmup_steps=3, sft_warmup_steps=-1)
    assert lr_at(same, "sft", 0) == pytest.approx(3e-3 / 4)
    own = _config(sft_steps=9, steps=5, warmup_steps=0, sft_warmup_steps=1)
    assert lr_at(own, "sft", 0) == pytest.approx(3e-3 / 2) and lr_at(own, "rl", 0) == 3e-4


def test_a_phase_shorter_than_its_warmup_ends_at_its_peak():
    """A run shortened below the config's warm-up warms up over all its steps but the last."""
    cfg = _config(sft_steps=3, steps=1, warmup_steps=4)
    assert [lr_at(cfg, "sft", s) for s in range(3)] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert lr_at(cfg, "rl", 0) == 3e-4


def test_same_follows_lr_schedule():
    cfg = _config(sft_steps=9, steps=5, lr_schedule="linear", sft_lr_schedule="same")
    assert lr_at(cfg, "sft", 8) == 0.0 and lr_at(cfg, "rl", 4) == 0.0


def test_each_phase_builds_adam_with_its_own_epsilon_and_peak():
    """The default's RL takes a large epsilon (updates that follow the gradient's size) while
    SFT keeps a small one; an SFT epsilon of 0 is the RL one."""
    model = torch.nn.Linear(3, 2)
    cfg = _config(sft_adam_eps=1e-8, adam_eps=1e-3)
    sft, rl = build_optimizer(model, cfg, "sft"), build_optimizer(model, cfg, "rl")
    assert (sft.defaults["eps"], sft.defaults["lr"]) == (1e-8, 3e-3)
    assert (rl.defaults["eps"], rl.defaults["lr"]) == (1e-3, 3e-4)
    assert build_optimizer(model, _config(sft_adam_eps=0.0), "sft").defaults["eps"] == (
        cfg.train.adam_eps
    )


def test_rl_length_is_free_unless_it_moves_a_cut_warmup():
    """A resume may change train.steps where the RL schedule does not depend on it; a warm-up
    cut short by one length and not by the other makes it depend."""

    def values(steps: int) -> dict:
        return {"train.steps": steps, "train.warmup_steps": 4, "train.lr_schedule": "constant",
                "algo.exploration_beta": 0.0}  # fmt: skip

    assert _rl_length_free(values(24), values(48))
    assert _rl_length_free(values(0), values(2))  # no RL step taken under the recorded length
    assert not _rl_length_free(values(2), values(24))  # warm-up 1 step, then 4
    assert _rl_length_free(values(5), values(24))  # 4 either way


def _two_layers(seed: int, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(device)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        inputs = torch.randn(4, 7, generator=generator).to(next(model.parameters()).device)
        model(inputs).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _host_and_torch(fused: bool, device: str = "cpu", steps: int = 3):
    host_model, torch_model = _two_layers(0, device), _two_layers(0, device)
    host = HostAdamW(host_model.parameters(), **ADAMW, fused=fused)
    reference = torch.optim.AdamW(torch_model.parameters(), **ADAMW, fused=fused)
    _steps(host_model, host, steps)
    _steps(torch_model, reference, steps)
    return host_model, host, torch_model, reference


@pytest.mark.parametrize("fused", [False, True], ids=["single-tensor", "fused"])
def test_host_adamw_takes_torch_adamws_steps_bit_for_bit(fused):
    host_model, host, torch_model, reference = _host_and_torch(fused)
    for mine, theirs in zip(host_model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(host.state[mine][key], reference.state[theirs][key]), key


def test_host_adamw_state_survives_a_state_dict_round_trip():
    host_model, host, _, _ = _host_and_torch(False, steps=2)
    saved = {k: v.clone() for k, v in host_model.state_dict().items()}
    state = copy.deepcopy(host.state_dict())
    _steps(host_model, host, 1)

    again = _two_layers(5)
    again.load_state_dict(saved)
    restored = HostAdamW(again.parameters(), **ADAMW)
    restored.load_state_dict(state)
    assert all(m.device.type == "cpu" for s in restored.state.values() for m in s.values())
    _steps(again, restored, 1)
    for a, b in zip(host_model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("offloaded_first", [True, False], ids=["host-to-torch", "torch-to-host"])
def test_a_checkpoint_of_either_adamw_resumes_into_the_other(tmp_path, offloaded_first):
    """Through DCP as the trainer checkpoints: a run may turn `train.optimizer_offload` on or
    off when it resumes."""
    host_model, host, torch_model, reference = _host_and_torch(False, steps=2)
    saved_model, saved = (host_model, host) if offloaded_first else (torch_model, reference)
    model_state, optim_state = get_state_dict(saved_model, saved)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path))

    resumed_model = _two_layers(7)
    kind = torch.optim.AdamW if offloaded_first else HostAdamW
    resumed = kind(resumed_model.parameters(), **ADAMW)
    model_state, optim_state = get_state_dict(resumed_model, resumed)
    wanted = {"model": model_state, "optim": optim_state}
    dcp.load(wanted, checkpoint_id=str(tmp_path))
    set_state_dict(resumed_model, resumed, model_state_dict=wanted["model"],
                   optim_state_dict=wanted["optim"])  # fmt: skip
    _steps(resumed_model, resumed, 1)
    _steps(saved_model, saved, 1)
    for mine, theirs in zip(resumed_model.parameters(), saved_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_loading_a_state_dict_never_casts_the_moments_to_the_parameters_device(monkeypatch):
    """torch's loader casts every state tensor to its parameter's device: on CUDA, every moment
    of the model on the card at once, the memory offloading exists to avoid."""
    _, host, _, _ = _host_and_torch(False, steps=1)
    cast = []
    original = torch.optim.Optimizer._process_value_according_to_param_policy

    def recording(param, value, param_id, param_groups, key=None):
        cast.append(key)
        return original(param, value, param_id, param_groups, key)

    monkeypatch.setattr(
        torch.optim.Optimizer, "_process_value_according_to_param_policy", recording
    )
    again = HostAdamW(_two_layers(0).parameters(), **ADAMW)
    again.load_state_dict(copy.deepcopy(host.state_dict()))
    assert cast and set(cast) == {"step"}
    assert all(isinstance(s["exp_avg"], torch.Tensor) for s in again.state.values())


def test_optimizer_offload_builds_host_adamw():
    model = _two_layers(0)
    assert type(build_optimizer(model, _config(), "rl")) is torch.optim.AdamW
    offloaded = build_optimizer(model, _config(optimizer_offload="true"), "rl")
    assert type(offloaded) is HostAdamW and offloaded.defaults["lr"] == 3e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [False, True], ids=["single-tensor", "fused"])
def test_host_adamw_on_cuda_keeps_its_moments_pinned_and_steps_as_torch(fused):
    host_model, host, torch_model, reference = _host_and_torch(fused, "cuda")
    for mine, theirs in zip(host_model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
        for key in ("exp_avg", "exp_avg_sq"):
            moment = host.state[mine][key]
            assert moment.device.type == "cpu" and moment.is_pinned()
            assert torch.equal(moment, reference.state[theirs][key].cpu()), key
