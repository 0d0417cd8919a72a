"""The config's schema: one msgspec Struct per section, each field with its default, its bounds
and a one-line description (`msgspec.Meta`), so one source gives validation, `rlmtrain config
show` and the README's reference. The rules across fields are `rules.py`; reading TOML and
overrides is `loader.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from rlmtrain.errors import UserError

SEED_MAX = 2**32 - 1
"""The largest seed every generator a run seeds takes (numpy's is 32-bit)."""


class ConfigError(UserError, ValueError):
    """A bad run file or override; the message is one line naming the key and the file."""


def _doc(text: str, **bounds: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **bounds)


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(Section):
    preset: Annotated[
        str, _doc("architecture preset: tiny, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b")
    ] = "tiny"
    hf_dir: Annotated[
        str, _doc("Hugging Face checkpoint folder to load; empty = random init from the preset")
    ] = ""
    tokenizer: Annotated[
        str,
        _doc(
            "'byte' (built-in), 'bpe' (trained on the run's own corpus, saved in "
            "run_dir/tokenizer), or a folder with tokenizer.json; empty = hf_dir's"
        ),
    ] = "byte"
    bpe_vocab_size: Annotated[
        int, _doc("vocabulary of the trained tokenizer when tokenizer = 'bpe'", ge=259)
    ] = 2048
    bpe_split_digits: Annotated[
        bool,
        _doc(
            "the trained BPE keeps every digit a token of its own, so a number it never saw "
            "(a held-out package's 'delta72') splits like those it did ('iris0')"
        ),
    ] = False
    vocab_size: Annotated[
        int, _doc("embedding rows of a randomly initialised model; 0 = the preset's", ge=0)
    ] = 0
    dtype: Annotated[
        Literal["float32", "bfloat16"],
        _doc("compute dtype of training and rollouts; trained weights stay fp32 masters"),
    ] = "float32"
    attention: Annotated[
        Literal["auto", "flash", "flex", "sdpa"],
        _doc("attention backend; auto = flash-attn on CUDA when installed, else flex"),
    ] = "auto"
    activation_checkpointing: Annotated[
        bool, _doc("recompute each decoder layer in backward to save memory")
    ] = False
    compile_layers: Annotated[
        bool,
        _doc(
            "fuse each decoder layer's norms, RoPE, SwiGLU and residual adds with torch.compile "
            "(the training forward; attention stays outside, the native engine eager)"
        ),
    ] = False
    seed: Annotated[int, _doc("seed for random initialisation", ge=0, le=SEED_MAX)] = 0


class DataConfig(Section):
    env: Annotated[str, _doc("environment name from the registry: evidence, booknav, codenav")] = (
        "evidence"
    )
    train_path: Annotated[
        str, _doc("training tasks (msgspec JSONL); empty = synthesise into run_dir/data")
    ] = ""
    sft_path: Annotated[
        str,
        _doc("SFT tasks for the scripted teacher; empty = synthesised (or train_path's if set)"),
    ] = ""
    eval_path: Annotated[
        str, _doc("held-out evaluation tasks; empty = synthesised into run_dir/data/eval")
    ] = ""
    synth_groups: Annotated[
        int,
        _doc(
            "groups synthesised for RL when train_path is empty (evidence: paper groups; "
            "codenav: packages; booknav: problems)",
            ge=1,
        ),
    ] = 8
    sft_groups: Annotated[
        int, _doc("groups synthesised for SFT when sft_path and train_path are empty", ge=1)
    ] = 4
    eval_groups: Annotated[
        int, _doc("groups synthesised for held-out evaluation when eval_path is empty", ge=1)
    ] = 4
    synth_max_papers: Annotated[
        int, _doc("most papers in a synthesised group (multi-paper tasks need >= 2)", ge=1, le=10)
    ] = 10
    seed: Annotated[int, _doc("seed for data synthesis and task order", ge=0, le=SEED_MAX)] = 0
    teacher_flawed_share: Annotated[
        float,
        _doc(
            "share of the SFT tasks the scripted teacher plays with a flawed variant of its plan, "
            "one token away from it (evidence, compact plans: a child quoting too little or too "
            "much; codenav: answering with the body's first call), so that SFT leaves RL a "
            "choice to learn; 0 = the plan alone",
            ge=0,
            lt=1,
        ),
    ] = 0.0


class RolloutConfig(Section):
    engine: Annotated[Literal["native", "vllm", "sim"], _doc("inference engine")] = "native"
    n_samples: Annotated[int, _doc("G: root trajectories sampled per task", ge=1)] = 4
    max_turns: Annotated[int, _doc("turns per trajectory before finish_reason=max_turns", ge=1)] = 6
    max_depth: Annotated[int, _doc("deepest recursion level; the root is depth 0", ge=0)] = 1
    depth_limit_mode: Annotated[
        Literal["lm", "error"], _doc("rlm_query at max_depth: a plain LM call, or an error string")
    ] = "lm"
    max_children_per_call: Annotated[
        int, _doc("prompts allowed in one rlm_query_batched call", ge=1)
    ] = 10
    max_children_per_trajectory: Annotated[
        int, _doc("child trajectories one trajectory may spawn in all", ge=0)
    ] = 16
    max_new_tokens: Annotated[int, _doc("completion tokens per turn", ge=1)] = 512
    max_prompt_tokens: Annotated[
        int, _doc("prompt tokens per turn before finish_reason=context", ge=16)
    ] = 8192
    temperature: Annotated[
        float, _doc("sampling temperature; log-probs are those of this distribution", gt=0)
    ] = 1.0
    top_p: Annotated[
        float, _doc("nucleus sampling mass; < 1 biases the trainer/sampler ratio", gt=0, le=1)
    ] = 1.0
    max_inflight_requests: Annotated[int, _doc("engine requests in flight at once", ge=1)] = 64
    max_live_trees: Annotated[int, _doc("root trajectories running at once", ge=1)] = 32
    max_live_workers: Annotated[int, _doc("REPL worker processes alive at once", ge=1)] = 128
    priority: Annotated[
        Literal["depth", "critical_path"],
        _doc(
            "which queued engine request goes first within a step: depth (deeper first, then "
            "older trees) or critical_path (the longest expected chain of turns to its tree's "
            "end first, estimated from the turns of trajectories already ended)"
        ),
    ] = "depth"
    repl_timeout_s: Annotated[
        float, _doc("wall-clock seconds per REPL exec, child calls not counted", gt=0)
    ] = 30.0
    repl_memory_mb: Annotated[
        int,
        _doc("memory limit of a REPL worker in MiB: address space, and its memory cgroup", ge=64),
    ] = 2048
    output_limit_chars: Annotated[
        int, _doc("printed REPL output kept per exec (head and tail)", ge=64)
    ] = 4000
    tree_timeout_s: Annotated[
        float, _doc("wall-clock seconds for a whole tree before finish_reason=timeout", gt=0)
    ] = 600.0
    prompt_style: Annotated[
        Literal["full", "compact"],
        _doc("system prompt and messages: full docs, or a few hundred tokens for small models"),
    ] = "full"
    max_batch_size: Annotated[
        int,
        _doc(
            "sequences decoded together (vLLM: max_num_seqs, raised to max_inflight_requests)", ge=1
        ),
    ] = 32
    kv_cache_tokens: Annotated[
        int, _doc("KV-cache capacity in tokens (native; vLLM on a CPU)", ge=64)
    ] = 65536
    gpu_memory_utilization: Annotated[
        float, _doc("vLLM on CUDA: share of the GPU's memory, KV cache included", gt=0, le=1)
    ] = 0.5
    weight_sync_bucket_mb: Annotated[
        float, _doc("vLLM: MiB of weights per update call (a larger tensor goes alone)", gt=0)
    ] = 64.0
    colocate: Annotated[
        bool,
        _doc(
            "vLLM on CUDA: the engine sleeps through the train steps, freeing its weights and "
            "KV cache, and wakes for the next rollout: weights, then the sync, then KV cache"
        ),
    ] = False
    inference_ranks: Annotated[
        int,
        _doc(
            "the last k ranks of a torchrun world each run an engine and a scheduler for the RL "
            "steps' rollouts and the others train; 0 = every rank does both, in turn",
            ge=0,
        ),
    ] = 0
    chat_template_kwargs: Annotated[
        dict[str, str | int | float | bool],
        _doc(
            "extra variables of the chat template at every render, rollouts and SFT alike "
            "(Qwen3: {enable_thinking = false})"
        ),
    ] = msgspec.field(default_factory=dict)


class AlgoConfig(Section):
    clip_low: Annotated[float, _doc("PPO clip below 1 (ratio >= 1 - clip_low)", ge=0, lt=1)] = 0.2
    clip_high: Annotated[float, _doc("PPO clip above 1 (ratio <= 1 + clip_high)", ge=0)] = 0.28
    dual_clip: Annotated[
        float, _doc("dual-clip bound c > 1 for negative advantages; 0 = off", ge=0)
    ] = 0.0
    kl_beta: Annotated[
        float, _doc("weight of the k3 KL to the reference policy; 0 = no reference model", ge=0)
    ] = 0.0
    tis_cap: Annotated[
        float, _doc("truncated importance-sampling cap on pi_old/pi_sampler; 0 = off", ge=0)
    ] = 2.0
    max_staleness: Annotated[
        int,
        _doc(
            "with rollout.inference_ranks: a step's roots start on weights at most this many "
            "updates older than those that train them (0 = rollout and training alternate)",
            ge=0,
        ),
    ] = 0
    std_normalize: Annotated[bool, _doc("divide group-centred rewards by the group std")] = True
    drop_uniform_groups: Annotated[
        bool, _doc("drop groups whose rewards are all equal (zero advantage)")
    ] = True
    token_aggregation: Annotated[
        Literal["token_mean", "turn_mean", "constant_sum"],
        _doc("how a trajectory's tokens form its loss"),
    ] = "token_mean"
    constant_sum_divisor: Annotated[
        float, _doc("divisor for token_aggregation=constant_sum", gt=0)
    ] = 1024.0
    child_credit: Annotated[
        Literal["inherit", "answered"],
        _doc(
            "what a descendant's turns carry: inherit = its root's advantage (the method); "
            "answered = the same, but a descendant that ended without an answer carries -|A| "
            "and never shares in its root's success"
        ),
    ] = "inherit"
    child_averaging: Annotated[
        bool, _doc("average children's losses by 1/k (the method); false = flat variant")
    ] = True
    micro_batch_tokens: Annotated[int, _doc("token budget of one packed micro-batch", ge=16)] = (
        16384
    )
    truncate_long_samples: Annotated[
        bool, _doc("truncate a sample longer than the budget instead of failing")
    ] = False
    shared_prefix_tokens: Annotated[
        int,
        _doc(
            "samples sharing at least this many leading tokens (the system prompt) forward "
            "them once per micro-batch; exact; 0 = off",
            ge=0,
        ),
    ] = 64
    exploration_beta: Annotated[
        float, _doc("initial weight of the exploration bonus; 0 = off", ge=0)
    ] = 0.0
    tool_credit_alpha: Annotated[float, _doc("alpha of turn-level tool credit; 0 = off", ge=0)] = (
        0.0
    )
    tool_credit: Annotated[
        Literal["rules", "judge"],
        _doc(
            "who labels each turn for the tool credit: the rules of rewards.tool_credit, or the "
            "[judge] model (one request per trajectory, the rules where it cannot answer)"
        ),
    ] = "rules"
    step_rewards: Annotated[
        Literal["off", "heuristic", "judge"],
        _doc(
            "rubric step rewards added to each turn's advantage (every trajectory, children "
            "too): off, the heuristic rubric of rewards.step_rubric, or relevance and coherence "
            "from the [judge] model (one request per trajectory, the heuristic where it cannot "
            "answer)"
        ),
    ] = "off"
    step_relevance_weight: Annotated[
        float, _doc("step rubric: weight of a turn's relevance to the query", ge=0)
    ] = 0.3
    step_info_gain_weight: Annotated[
        float, _doc("step rubric: weight of the novelty of a turn's output", ge=0)
    ] = 0.4
    step_coherence_weight: Annotated[
        float, _doc("step rubric: weight of a turn building on the history", ge=0)
    ] = 0.3
    step_cost: Annotated[float, _doc("step rubric: efficiency penalty each turn pays", ge=0)] = 0.05
    step_reward_baseline: Annotated[
        Literal["none", "group"],
        _doc(
            "what a turn's step reward is measured against: none (added as scored, the method) "
            "or group (less the mean over every turn of its group's trees, so the rubric moves "
            "credit between turns instead of raising every sampled token)"
        ),
    ] = "none"
    updates_per_batch: Annotated[
        int,
        _doc(
            "optimizer updates per rollout batch (PPO-style passes); 1 = pi_old is the detached "
            "current policy, > 1 = pi_old computed once before the first update",
            ge=1,
        ),
    ] = 1


class TrainConfig(Section):
    steps: Annotated[int, _doc("optimizer steps of the main phase", ge=0)] = 20
    sft_steps: Annotated[int, _doc("supervised warm-up steps before RL", ge=0)] = 20
    tasks_per_step: Annotated[int, _doc("tasks (GRPO groups) per optimizer step", ge=1)] = 4
    lr: Annotated[float, _doc("AdamW learning rate of the RL steps", gt=0)] = 1e-3
    sft_lr: Annotated[float, _doc("AdamW learning rate of the SFT steps; 0 = lr", ge=0)] = 0.0
    sft_step_tokens: Annotated[
        int, _doc("tokens of teacher samples per SFT optimizer step (packed turns)", ge=16)
    ] = 16384
    lr_schedule: Annotated[
        Literal["constant", "linear", "cosine"],
        _doc("LR over each phase (SFT, RL): warm up, then hold or decay to min_lr_ratio x peak"),
    ] = "constant"
    sft_lr_schedule: Annotated[
        Literal["same", "constant", "linear", "cosine"],
        _doc("LR schedule of the SFT phase alone; 'same' = lr_schedule"),
    ] = "same"
    warmup_steps: Annotated[
        int,
        _doc(
            "steps of linear LR warm-up at the start of each phase (at most all of a phase's "
            "steps but its last)",
            ge=0,
        ),
    ] = 0
    sft_warmup_steps: Annotated[
        int, _doc("steps of LR warm-up of the SFT phase alone; -1 = warmup_steps", ge=-1)
    ] = -1
    min_lr_ratio: Annotated[
        float, _doc("LR at a phase's last step over its peak, for linear and cosine", ge=0, le=1)
    ] = 0.0
    weight_decay: Annotated[float, _doc("AdamW weight decay", ge=0)] = 0.0
    adam_betas: Annotated[list[float], _doc("AdamW (beta1, beta2)")] = msgspec.field(
        default_factory=lambda: [0.9, 0.999]
    )
    adam_eps: Annotated[
        float, _doc("AdamW epsilon of the RL steps (and SFT's by default)", gt=0)
    ] = 1e-8
    sft_adam_eps: Annotated[float, _doc("AdamW epsilon of the SFT steps; 0 = adam_eps", ge=0)] = 0.0
    adam_fused: Annotated[bool, _doc("AdamW's fused implementation (one kernel per step)")] = False
    optimizer_offload: Annotated[
        bool,
        _doc("AdamW's two moments in host memory, brought to the device a parameter at a time"),
    ] = False
    grad_clip: Annotated[float, _doc("max global grad norm; 0 = off", ge=0)] = 1.0
    loss_impl: Annotated[
        Literal["auto", "torch", "triton", "unfused"],
        _doc(
            "LM-head loss: fused backend (auto = triton on CUDA), or unfused full logits (a check)"
        ),
    ] = "auto"
    device: Annotated[
        str, _doc("'auto', 'cpu', 'cuda' or 'cuda:N'", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    ] = "auto"
    seed: Annotated[int, _doc("seed for sampling and data order", ge=0, le=SEED_MAX)] = 0


class ParallelConfig(Section):
    replicate: Annotated[
        int,
        _doc(
            "HSDP: replicas of the model, each sharded over world / replicate ranks (one per "
            "node: shards stay inside a node, only gradients cross); 1 = FSDP over every rank",
            ge=1,
        ),
    ] = 1
    stall_timeout_s: Annotated[
        float,
        _doc(
            "stop the run when no rank has made progress (a completion, a micro-batch, a "
            "parameter gathered) for this long, naming the rank that holds it up; 0 = never "
            "(the process group's 30-minute timeout then ends a hung run)",
            ge=0,
        ),
    ] = 600.0


class CheckpointConfig(Section):
    dir: Annotated[str, _doc("run folder for checkpoints, logs and data", min_length=1)] = (
        "runs/tiny"
    )
    every: Annotated[
        int,
        _doc(
            "save a resumable checkpoint (sharded model and optimizer, trainer state, RNG) every "
            "N steps of each phase and at its end, under dir/checkpoints; 0 = none (the final "
            "export only)",
            ge=0,
        ),
    ] = 0
    keep: Annotated[int, _doc("resumable checkpoints kept, newest first", ge=1)] = 2
    resume: Annotated[
        bool,
        _doc(
            "resume from the newest complete checkpoint in dir (none yet: start fresh); false "
            "refuses a dir that holds checkpoints"
        ),
    ] = False


class LoggingConfig(Section):
    level: Annotated[Literal["debug", "info", "warning", "error"], _doc("log level")] = "info"
    every: Annotated[int, _doc("print metrics every N steps", ge=1)] = 1
    metrics_path: Annotated[
        str, _doc("JSONL file of per-step metrics; empty = run_dir/metrics.jsonl")
    ] = ""
    progress: Annotated[bool, _doc("a progress bar over the whole run on stderr")] = True
    tensorboard: Annotated[
        bool, _doc("write TensorBoard events to run_dir/tb when tensorboard is installed")
    ] = True
    wandb_project: Annotated[str, _doc("Weights & Biases project; empty = no W&B")] = ""
    wandb_mode: Annotated[
        Literal["online", "offline"], _doc("W&B mode; offline needs no network")
    ] = "offline"
    sample_trees: Annotated[
        int, _doc("rollout trees per RL step written to run_dir/samples.jsonl for auditing", ge=0)
    ] = 2
    plot: Annotated[bool, _doc("write run_dir/curves.png (reward and eval curves) at the end")] = (
        True
    )


class EvalConfig(Section):
    """Held-out evaluation (`rlmtrain eval`, and inside `train`)."""

    tasks: Annotated[int, _doc("held-out tasks evaluated; 0 = every held-out task", ge=0)] = 0
    samples: Annotated[int, _doc("k: trees sampled per task (pass@k)", ge=1)] = 1
    init_samples: Annotated[
        int,
        _doc(
            "trees per task at the evaluation before any training; 0 = eval.samples (a model "
            "trained from scratch answers nothing there, so one tree a task says as much)",
            ge=0,
        ),
    ] = 0
    every: Annotated[
        int,
        _doc("evaluate every N RL steps (also at init, after SFT and at the end); 0 = off", ge=0),
    ] = 0
    seed: Annotated[
        int, _doc("sampling seed of every evaluation (same seed, same numbers)", ge=0, le=SEED_MAX)
    ] = 1234


class JudgeConfig(Section):
    """The judge model behind an OpenAI-compatible chat-completions endpoint (rewards/)."""

    base_url: Annotated[
        str, _doc("OpenAI-compatible base URL up to /v1; empty = no judge (span F1 where it can)")
    ] = ""
    model: Annotated[str, _doc("model name sent in each request")] = "judge"
    api_key_env: Annotated[str, _doc("environment variable with the API key; empty = no key")] = ""
    max_concurrency: Annotated[int, _doc("requests in flight", ge=1)] = 16
    timeout_s: Annotated[float, _doc("seconds per request attempt", gt=0)] = 60.0
    max_retries: Annotated[int, _doc("retries after the first attempt", ge=0)] = 4
    backoff_base_s: Annotated[float, _doc("first backoff delay in seconds", ge=0)] = 1.0
    backoff_max_s: Annotated[float, _doc("longest backoff delay in seconds", ge=0)] = 30.0
    temperature: Annotated[float, _doc("judge sampling temperature", ge=0)] = 0.0
    max_tokens: Annotated[int, _doc("judge reply token limit", ge=1)] = 512
    response_format: Annotated[
        Literal["json_schema", "json_object", "none"],
        _doc(
            "ask for the reply type's JSON schema (json_object if the server refuses it with "
            "HTTP 400), any JSON object, or nothing; replies are validated either way"
        ),
    ] = "json_schema"
    cache_path: Annotated[str, _doc("JSONL cache of replies across runs; empty = memory only")] = ""
    on_unscored: Annotated[
        Literal["span_f1", "drop"],
        _doc("a sample the judge could not score: fall back to span F1, or drop it from its group"),
    ] = "span_f1"


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)


SECTIONS: dict[str, type[Section]] = {
    name: info.type
    for name, info in zip(Config.__struct_fields__, msgspec.structs.fields(Config), strict=True)
}

ROLLOUT_DEFAULTS = RolloutConfig()
"""The rollout section at its defaults: where the agent's, the REPL's and the sampler's own
defaults are read from, so each limit is declared once (here) and read, never repeated."""
