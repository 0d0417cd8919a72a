"""Fixed rollouts, a few optimizer steps of the trainer's own GRPO step, on however many ranks
this process is one of (alone, or under torchrun); rank 0 saves the resulting master weights.

    python tests/distributed_steps.py OUT [--steps 3] [--dtype bfloat16] [--lr 1e-3] [...]
    torchrun --nproc_per_node 2 tests/distributed_steps.py OUT ...
    torchrun --nproc_per_node 4 tests/distributed_steps.py OUT --replicate 2   (HSDP, 2 x 2)

The rollouts are three hand-made groups of one-turn roots with completions of unequal lengths,
their engine log-probs those of the initial model, so every run trains on exactly the same
samples however they are dealt. `tests/test_distributed.py` runs it and compares.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import msgspec
import torch
from torch._dynamo.utils import counters

from rlmtrain import parallel
from rlmtrain.algo import build_samples, compute_advantages, pack
from rlmtrain.config import Config, ModelConfig
from rlmtrain.kernels import fused_linear_logprob
from rlmtrain.model import build_model
from rlmtrain.optim import build_optimizer
from rlmtrain.rewards.step_rewards import StepRewards
from rlmtrain.rlm.records import RolloutGroup, Trajectory, Turn
from rlmtrain.rollout.engines.native import NativeEngine
from rlmtrain.training.rl import reference_policy
from rlmtrain.training.run import EngineSync
from rlmtrain.training.steps import DTYPES, grpo_step

PROMPT = list(b"<|im_start|>user\nname a colour<|im_end|>\n<|im_start|>assistant\n")


def fixed_samples(model, cfg: Config):
    groups, rewards = [], []
    for g in range(3):
        roots = []
        for i in range(3):
            ids = list(f"answer {g}.{i} ".encode()) * (1 + (7 * g + 3 * i) % 9)
            full = torch.tensor(PROMPT + ids)
            with torch.no_grad():
                hidden = model(
                    full[:-1], torch.arange(len(full) - 1), torch.tensor([0, len(full) - 1])
                )
                logp = fused_linear_logprob(hidden, model.lm_head_weight, full[1:])
            turn = Turn(
                prompt_ids=PROMPT,
                completion_ids=ids,
                sampler_logprobs=logp[len(PROMPT) - 1 :].tolist(),
            )
            roots.append(
                Trajectory(
                    id=f"t{g}#{i}", root_id=f"t{g}#{i}", parent_id=None, depth=0,
                    task_id=f"t{g}", sample_idx=i, prompt="name a colour",
                    finish_reason="final", answer="x", turns=[turn],
                )
            )  # fmt: skip
        groups.append(RolloutGroup(task={"id": f"t{g}"}, trajectories=roots))
        rewards.append([float((i + g) % 3) for i in range(3)])
    advantages, _ = compute_advantages(groups, StepRewards(roots=rewards), cfg.algo)
    return build_samples(groups, advantages, cfg.algo)


async def _engine_misses(model, cfg: Config, state) -> list[str]:
    """The names of `state` that this rank's own engine, synced as training syncs it (each
    parameter gathered from the shards in lockstep as the engine takes it), lacks or holds
    other bits of, and of the engine's parameters `state` lacks; [] when they are equal."""
    served_model = build_model(msgspec.structs.replace(cfg.model, dtype="float32"))
    engine = NativeEngine(served_model, max_batch_size=1, kv_cache_tokens=64)
    try:
        await EngineSync(engine, model, colocate=False)()
        served = dict(engine.model.named_parameters())
        return sorted(
            name
            for name in served.keys() | state.keys()
            if name not in served or name not in state or not torch.equal(served[name], state[name])
        )
    finally:
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--kl-beta", type=float, default=0.0)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--optimizer-offload", action="store_true")
    parser.add_argument("--compile-layers", action="store_true")
    args = parser.parse_args()
    # Past the recompile limit dynamo would run the compiled layers eager with only a warning.
    torch._dynamo.config.fail_on_recompile_limit_hit = True

    world, device = parallel.start("cpu")
    try:
        cfg = Config()
        cfg = msgspec.structs.replace(
            cfg,
            model=ModelConfig(
                preset="tiny",
                vocab_size=300,
                dtype=args.dtype,
                activation_checkpointing=args.activation_checkpointing,
                compile_layers=args.compile_layers,
            ),
            algo=msgspec.structs.replace(cfg.algo, kl_beta=args.kl_beta, micro_batch_tokens=256),
            train=msgspec.structs.replace(
                cfg.train,
                lr=args.lr,
                adam_eps=args.adam_eps,
                sft_steps=0,
                grad_clip=0.0,
                optimizer_offload=args.optimizer_offload,
            ),
        )
        model = build_model(msgspec.structs.replace(cfg.model, dtype="float32"))
        samples = fixed_samples(model, cfg)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        model = parallel.shard(model, device, DTYPES[args.dtype], args.replicate)
        optimizer = build_optimizer(model, cfg, "rl")
        reference = reference_policy(cfg, model, device, None, 0)
        packed = pack(samples, cfg.algo.micro_batch_tokens, world_size=world.size)
        mine = [len(mb.sample_indices) for mb in packed.micro_batches(world.rank)]
        counts = parallel.all_gather(sum(mine))
        losses = []
        for _ in range(args.steps):
            row = grpo_step(model, optimizer, packed, cfg, device, reference, rank=world.rank)
            losses.append(row["loss"])
        state = parallel.full_state(model)
        engine_misses = parallel.all_gather(asyncio.run(_engine_misses(model, cfg, state)))
        if world.is_main:
            changed = sum(int((state[k] != initial[k]).sum()) for k in state)
            total = sum(v.numel() for v in state.values())
            torch.save({k: v.detach().cpu() for k, v in state.items()}, args.out)
            summary = {
                "samples_per_rank": counts,
                "losses": losses,
                "changed_fraction": changed / total,
                "dtypes": sorted({str(v.dtype) for v in state.values()}),
                "engine_misses": engine_misses,
                "mesh": list(next(model.parameters()).device_mesh.shape),
                "optimizer": type(optimizer).__name__,
                "compiled_graphs": counters["stats"]["unique_graphs"],
            }
            print(json.dumps(summary))
    finally:
        parallel.stop()


if __name__ == "__main__":
    main()
