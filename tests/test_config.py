"""Config loading, overrides, and the CLI's one-line errors (exit 2) through a real subprocess."""

import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rlmtrain.config import Config, ConfigError, RolloutConfig, load_config, to_toml

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlmtrain", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.fixture
def run_file(tmp_path):
    def write(text: str) -> Path:
        path = tmp_path / "run.toml"
        path.write_text(text)
        return path

    return write


def test_defaults_and_overrides_convert_types(run_file):
    path = run_file('[train]\nlr = 3e-4\n[model]\npreset = "qwen3-4b"\n')
    cfg = load_config(
        path,
        [
            "--train.steps=7",
            "--algo.std_normalize=false",
            "--model.preset=tiny",
            "--checkpoint.dir=out/x",
        ],
    )
    assert cfg.train.lr == 3e-4
    assert cfg.train.steps == 7
    assert cfg.algo.std_normalize is False
    assert cfg.model.preset == "tiny"
    assert cfg.checkpoint.dir == "out/x"
    assert cfg.rollout == Config().rollout


def test_a_text_key_takes_the_text_as_written():
    """TOML would read these as a number or a boolean; the keys hold text."""
    cfg = load_config(None, ["--checkpoint.dir=1e3", "--logging.metrics_path=true"])
    assert cfg.checkpoint.dir == "1e3" and cfg.logging.metrics_path == "true"
    assert load_config(None, ['--checkpoint.dir="quoted"']).checkpoint.dir == "quoted"


def test_show_output_round_trips(run_file):
    cfg = load_config(None, ["--rollout.temperature=0.7", "--data.env=booknav"])
    again = load_config(run_file(to_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize(
    ("text", "overrides", "named"),
    [
        ("[model]\nfoo = 1\n", [], "model.foo"),
        ("[nosuch]\nx = 1\n", [], "nosuch"),
        ('[train]\nsteps = "ten"\n', [], "train.steps"),
        ("[algo]\nclip_low = 1.5\n", [], "algo.clip_low"),
        ('[model]\ndtype = "float8"\n', [], "model.dtype"),
        ("", ["--rollout.max_turns=0"], "rollout.max_turns"),
        ("", ["--train.nosuch=1"], "train.nosuch"),
        ("", ["--train.lr=fast"], "train.lr"),
        ("", ["--train.device=gpu"], "train.device"),
        ("", ["--train.seed=-1"], "train.seed"),
        ("", ["--model.seed=4294967296"], "model.seed"),
        ("[train]\nlr = inf\n", [], "key 'train.lr': must be finite, got inf"),
        ("", ["--algo.kl_beta=inf"], "key 'algo.kl_beta': must be finite"),
        ("", ["--train.adam_betas=[0.9, inf]"], r"key 'train.adam_betas\[1\]': must be finite"),
        ("", ["--eval.samples=100000000000000000000"], "key 'eval.samples': must fit in 64 bits"),
        ("", ["--checkpoint.dir="], "key 'checkpoint.dir': Expected `str` of length >= 1"),
    ],
)
def test_bad_input_names_the_key(run_file, text, overrides, named):
    path = run_file(text)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(path, overrides)


@pytest.mark.parametrize(
    ("text", "overrides", "named"),
    [
        ("[model]\nfoo = 1\n", [], "unknown key 'model.foo'"),
        ('[train]\nsteps = "ten"\n', [], "key 'train.steps'"),
        ("[algo]\nclip_low = -0.1\n", [], "key 'algo.clip_low'"),
        ("", ["--rollout.n_samples=0"], "key 'rollout.n_samples'"),
        ("[model\n", [], "not valid TOML"),
    ],
)
def test_cli_exits_2_with_one_line(run_file, text, overrides, named):
    path = run_file(text)
    result = run_cli("config", "show", "--config", str(path), *overrides)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert named in lines[0]
    assert str(path) in lines[0]
    assert "Traceback" not in result.stderr


def test_cli_missing_file():
    result = run_cli("config", "show", "--config", "no/such/file.toml")
    assert result.returncode == 2
    assert "no/such/file.toml" in result.stderr
    assert "not found" in result.stderr


def test_cli_show_prints_resolved_toml():
    result = run_cli("config", "show", "--config", "configs/tiny-cpu.toml", "--train.steps=3")
    assert result.returncode == 0, result.stderr
    parsed = tomllib.loads(result.stdout)
    assert parsed["train"]["steps"] == 3
    assert set(parsed) == set(Config.__struct_fields__)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    load_config(path)


def test_shipped_configs_pass_the_trainers_preflight():
    from rlmtrain.config import preflight

    for config in sorted((ROOT / "configs").glob("*.toml")):
        assert preflight(load_config(config)) == "", config.name


# One case per cross-field rule: the overrides that break it, and the key the error must name.
LONG_TURNS = "--rollout.max_prompt_tokens=1000"
PREFLIGHT_CASES = [
    (["--algo.micro_batch_tokens=1024", LONG_TURNS], "algo.micro_batch_tokens"),
    (["--rollout.kv_cache_tokens=1000", LONG_TURNS], "rollout.kv_cache_tokens"),
    (["--rollout.max_depth=3", "--rollout.max_live_workers=3"], "rollout.max_live_workers"),
    (["--algo.dual_clip=1.1"], "algo.dual_clip"),
    (["--algo.tis_cap=0.5"], "algo.tis_cap"),
    (["--algo.step_rewards=judge"], "algo.step_rewards"),
    (["--algo.tool_credit=judge", "--algo.tool_credit_alpha=0.5"], "algo.tool_credit"),
    (["--algo.tool_credit=judge", "--judge.base_url=http://127.0.0.1:9/v1"], "algo.tool_credit"),
    (["--algo.updates_per_batch=2", "--algo.clip_low=0", "--algo.clip_high=0"],
     "algo.updates_per_batch"),
    (["--train.adam_betas=[0.9]"], "train.adam_betas"),
    (["--train.sft_lr_schedule=same", "--train.min_lr_ratio=0.1"], "train.min_lr_ratio"),
    (["--algo.child_credit=answered", "--rollout.max_depth=0"], "algo.child_credit"),
    (["--algo.step_rewards=off", "--algo.step_reward_baseline=group"],
     "algo.step_reward_baseline"),
    (["--model.tokenizer=bpe", "--model.hf_dir=some/folder"], "model.tokenizer"),
    (["--model.tokenizer=byte", "--model.bpe_split_digits=true"], "model.bpe_split_digits"),
    (["--rollout.colocate=true"], "rollout.colocate"),
    (["--algo.max_staleness=1"], "algo.max_staleness"),
    (["--algo.max_staleness=1", "--rollout.inference_ranks=1", "--algo.tis_cap=0"],
     "algo.max_staleness"),
]  # fmt: skip


def test_inference_ranks_without_a_launched_world_are_refused_in_one_line(tmp_path):
    """A process not started by torchrun has no ranks to give to rollouts."""
    result = run_cli(
        "train", "--config", "configs/tiny-cpu.toml", f"--checkpoint.dir={tmp_path}",
        "--rollout.inference_ranks=1",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert (
        "rollout.inference_ranks: 1 inference rank(s) need a world launched by torchrun" in lines[0]
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides, key", PREFLIGHT_CASES, ids=[k for _, k in PREFLIGHT_CASES])
def test_train_refuses_a_broken_cross_field_rule_in_one_line(tmp_path, overrides, key):
    """Through the trainer's own entry, before any work: exit 2, one line naming the key."""
    result = run_cli(
        "train", "--config", "configs/tiny-cpu.toml", f"--checkpoint.dir={tmp_path}", *overrides
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"key '{key}'" in lines[0]
    assert not any(tmp_path.iterdir())  # refused before the run folder got anything


def test_colocation_off_cuda_is_refused_in_one_line(tmp_path):
    """vLLM's sleep mode exists on CUDA only; on a CPU run the key would do nothing."""
    result = run_cli(
        "train", "--config", "configs/tiny-cpu.toml", f"--checkpoint.dir={tmp_path}",
        "--rollout.engine=vllm", "--rollout.colocate=true", "--train.device=cpu",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "rollout.colocate" in lines[0] and "cpu" in lines[0]
    assert not any(tmp_path.iterdir())


def test_triton_losses_where_they_cannot_run_are_refused_in_one_line(tmp_path, monkeypatch):
    """Before any work (it used to fail at the first SFT step, after the data and the teacher)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = run_cli(
        "train", "--config", "configs/tiny-cpu.toml", f"--checkpoint.dir={tmp_path}",
        "--train.loss_impl=triton", "--train.device=cpu",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "train.loss_impl: 'triton' cannot run on cpu" in lines[0], lines[0]
    assert "TRITON_INTERPRET=1" in lines[0], lines[0]
    assert not any(tmp_path.iterdir())


def test_micro_batch_rule_yields_to_truncation():
    overrides = ["--algo.micro_batch_tokens=1024", "--rollout.max_prompt_tokens=1000"]
    load_config(
        ROOT / "configs" / "tiny-cpu.toml", [*overrides, "--algo.truncate_long_samples=true"]
    )


def test_agent_and_repl_limits_default_to_the_config():
    """The rollout section declares every limit once; the agent's and the REPL's defaults are
    read from it, so a default changed there changes them."""
    from rlmtrain.rlm.agent import AgentLimits
    from rlmtrain.rlm.generation import SamplingParams
    from rlmtrain.rlm.repl import ReplLimits

    rollout = RolloutConfig()
    assert AgentLimits() == AgentLimits.from_config(rollout)
    assert ReplLimits() == ReplLimits.from_config(rollout)
    assert SamplingParams().max_new_tokens == rollout.max_new_tokens


def test_train_without_its_judge_served_stops_in_one_line(tmp_path):
    """booknav-cpu needs the judge README's "Serving a judge" starts; with nothing at its URL the
    run stops before any work, naming the key, instead of spending every request's retries."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    result = run_cli(
        *("train", "--config", "configs/booknav-cpu.toml", f"--checkpoint.dir={tmp_path}"),
        f"--judge.base_url=http://127.0.0.1:{port}/v1",
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "judge.base_url: nothing answers at" in lines[0], result.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def _train_refusal(tmp_path: Path, *overrides: str) -> str:
    result = run_cli(
        "train", "--config", "configs/tiny-cpu.toml", f"--checkpoint.dir={tmp_path / 'run'}",
        *overrides,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_train_refuses_an_unknown_preset_or_environment_in_one_line(tmp_path):
    line = _train_refusal(tmp_path, "--model.preset=qwen9")
    assert "model.preset" in line and "'qwen9'" in line and "tiny" in line, line
    line = _train_refusal(tmp_path, "--data.env=nosuch")
    assert "data.env" in line and "'nosuch'" in line and "evidence" in line, line


def test_train_refuses_run_paths_it_could_not_write_in_one_line(tmp_path):
    """Each at the start, not hours later when the run first writes there."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    result = run_cli(
        "train", "--config", "configs/tiny-cpu.toml", f"--checkpoint.dir={a_file / 'run'}"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "checkpoint.dir" in result.stderr and str(a_file) in result.stderr
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "final").write_text("")
    line = _train_refusal(tmp_path, "--data.sft_groups=1")
    assert "checkpoint.dir" in line and "final" in line and "is a file" in line, line
    (tmp_path / "run" / "final").unlink()
    line = _train_refusal(tmp_path, f"--logging.metrics_path={tmp_path}")
    assert "logging.metrics_path" in line and "folder" in line, line
    assert not list(tmp_path.glob("*.partial"))


def test_python_dash_m_rlmtrain_is_the_command():
    result = subprocess.run(
        [sys.executable, "-m", "rlmtrain", "config", "show", "--train.steps=3"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout)["train"]["steps"] == 3
