"""An env's scripted teacher played through the real scheduler, as RL rollouts are.

Cold-start SFT data (docs/algorithm.md §5) must be the records a policy leaves, so the teacher's
reply (`Env.teacher`) stands in for the model behind a scripted engine (`SimEngine`), and
everything else is what an RL rollout uses: the `Scheduler`, its admission, limits, REPLs and
records.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rlmtrain.config import RolloutConfig
from rlmtrain.rlm.records import RolloutGroup
from rlmtrain.rollout.engines.sim import SimEngine, text_script
from rlmtrain.rollout.scheduler import Scheduler

log = logging.getLogger("rlmtrain")


async def teach(
    env: Any, tasks: Sequence[Any], tokenizer: Any, config: RolloutConfig
) -> list[RolloutGroup]:
    """One teacher tree per task, in task order, under `config`'s limits. Trajectories that did
    not finish are logged (by reason)."""
    who = f"{env.name} teacher"
    engine = SimEngine(
        script=text_script(tokenizer, env.teacher(config)),
        eos_id=tokenizer.eos_id,
        max_batch_size=config.max_batch_size,
        decode=tokenizer.decode,
    )
    try:
        groups = await Scheduler(engine, tokenizer, config).rollout(list(tasks), env, 1)
    finally:
        await engine.close()
    unfinished = Counter(
        t.finish_reason for g in groups for t in g.trajectories if t.finish_reason != "final"
    )
    if unfinished:
        log.warning(
            "%s: %d of %d trajectories did not finish (%s); max_prompt_tokens=%d",
            who,
            sum(unfinished.values()),
            sum(len(g.trajectories) for g in groups),
            ", ".join(f"{reason}: {n}" for reason, n in unfinished.most_common()),
            config.max_prompt_tokens,
        )
    return groups
