"""The config's rules across fields: the limits one key sets for another, which the schema's
per-field bounds cannot see. Each would otherwise fail mid-run, on the first long turn or the
first deep tree. Checked whenever a config loads (`loader.load_config`).
"""

from __future__ import annotations

from rlmtrain.config.schema import Config, RolloutConfig

__all__ = ["preflight", "too_few_workers"]


def too_few_workers(rollout: RolloutConfig) -> str:
    """Why `rollout.max_live_workers` cannot run a tree of `max_depth`, or "" when it can: each
    level of a tree holds its REPL worker while it waits on its child."""
    if rollout.max_live_workers >= rollout.max_depth + 1:
        return ""
    return (
        f"rollout.max_live_workers={rollout.max_live_workers} must be at least max_depth + 1 = "
        f"{rollout.max_depth + 1}: one worker per REPL level of a tree"
    )


def preflight(config: Config) -> str:
    """The first rule across fields that `config` breaks, as "key 'section.key': why"; "" when
    it keeps them all. These are the limits one key sets for another, which the schema's
    per-field bounds cannot see; each would otherwise fail mid-run, on the first long turn or
    the first deep tree."""
    model, rollout, algo, train = config.model, config.rollout, config.algo, config.train
    longest_turn = rollout.max_prompt_tokens + rollout.max_new_tokens
    rules = [
        (
            "algo.micro_batch_tokens",
            algo.micro_batch_tokens >= longest_turn or algo.truncate_long_samples,
            f"{algo.micro_batch_tokens} is less than the longest possible turn "
            f"(rollout.max_prompt_tokens + rollout.max_new_tokens = {longest_turn}); raise it, "
            "lower those, or set algo.truncate_long_samples = true",
        ),
        (
            "rollout.kv_cache_tokens",
            rollout.engine != "native" or rollout.kv_cache_tokens >= longest_turn,
            f"{rollout.kv_cache_tokens} cannot hold one turn of rollout.max_prompt_tokens + "
            f"rollout.max_new_tokens = {longest_turn} tokens",
        ),
        ("rollout.max_live_workers", not too_few_workers(rollout), too_few_workers(rollout)),
        (
            "rollout.colocate",
            not rollout.colocate or rollout.engine == "vllm",
            "only vLLM sleeps to share a GPU with the trainer; rollout.engine is "
            f"'{rollout.engine}'",
        ),
        (
            "algo.dual_clip",
            algo.dual_clip == 0 or algo.dual_clip > 1 + algo.clip_high,
            f"{algo.dual_clip} must be 0 (off) or above 1 + algo.clip_high = "
            f"{1 + algo.clip_high}, where the ordinary clip ends",
        ),
        (
            "algo.tis_cap",
            algo.tis_cap == 0 or algo.tis_cap >= 1,
            f"{algo.tis_cap} would cap even on-policy tokens below weight 1; use 0 (off) or >= 1",
        ),
        (
            "algo.max_staleness",
            algo.max_staleness == 0 or rollout.inference_ranks > 0,
            "rollouts run ahead of training only on ranks of their own; set "
            "rollout.inference_ranks",
        ),
        (
            "algo.max_staleness",
            algo.max_staleness == 0 or algo.tis_cap > 0,
            "tokens sampled by older weights need the truncated-IS correction; set algo.tis_cap",
        ),
        (
            "algo.updates_per_batch",
            algo.updates_per_batch == 1 or algo.clip_low > 0 or algo.clip_high > 0,
            "several updates per batch with no clip (algo.clip_low = algo.clip_high = 0) let "
            "the policy run away from pi_old",
        ),
        (
            "algo.step_rewards",
            algo.step_rewards != "judge" or bool(config.judge.base_url),
            "'judge' asks the judge model; set judge.base_url",
        ),
        (
            "algo.tool_credit",
            algo.tool_credit != "judge" or bool(config.judge.base_url),
            "'judge' asks the judge model; set judge.base_url",
        ),
        (
            "algo.tool_credit",
            algo.tool_credit != "judge" or algo.tool_credit_alpha > 0,
            "'judge' labels turns for the tool credit, which algo.tool_credit_alpha = 0 turns off",
        ),
        (
            "algo.child_credit",
            algo.child_credit == "inherit" or rollout.max_depth > 0,
            "'answered' credits children, but rollout.max_depth = 0 grows none",
        ),
        (
            "algo.step_reward_baseline",
            algo.step_reward_baseline == "none" or algo.step_rewards != "off",
            "a baseline for step rewards, but algo.step_rewards = 'off' scores no step",
        ),
        (
            "train.adam_betas",
            len(train.adam_betas) == 2 and all(0 <= b < 1 for b in train.adam_betas),
            f"{train.adam_betas} must be two numbers in [0, 1)",
        ),
        (
            "train.min_lr_ratio",
            train.min_lr_ratio == 0
            or train.lr_schedule != "constant"
            or train.sft_lr_schedule not in ("same", "constant"),
            f"{train.min_lr_ratio} is the floor of a decaying LR, but both phases hold theirs "
            "constant; set train.lr_schedule or train.sft_lr_schedule",
        ),
        (
            "model.bpe_split_digits",
            model.tokenizer == "bpe" or not model.bpe_split_digits,
            "splits digits in the BPE a run trains, but model.tokenizer is not 'bpe'",
        ),
        (
            "model.tokenizer",
            model.tokenizer != "bpe" or not model.hf_dir,
            "'bpe' trains a new vocabulary, but model.hf_dir brings its own; set "
            "model.tokenizer = '' to use the checkpoint's",
        ),
    ]
    for key, holds, why in rules:
        if not holds:
            return f"key '{key}': {why}"
    return ""
