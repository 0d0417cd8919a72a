"""The training loop's parts, which `rlmtrain/train.py` calls in order: the run's start
(`startup`), the run object the phases share (`run`), the SFT and RL phases (`sft`, `rl`) and the
step functions they run (`steps`: `sft_step`, `grpo_step`, public for loops of one's own)."""
