"""The run folder (`checkpoint.dir`): where each file a run writes, or a later command reads, lies.

    data/<split>/tasks.jsonl      the synthesised task sets ("sft", "rl", "eval"), synth.json beside
                                  each saying what made it
    tokenizer/                    the BPE trained for the run (`model.tokenizer = "bpe"`)
    checkpoints/<phase>-<step>/   resumable checkpoints (`checkpointing`)
    final/                        the trained model, a Hugging Face folder
    metrics.jsonl                 one line a step (`logging.metrics_path` puts it elsewhere)
    eval.jsonl, samples.jsonl     the held-out reports, the audited rollout trees
    tb/, curves.png               TensorBoard events, the closing plot
    ranks/<rank>.json             each rank's note at the start, read by rank 0 to check that
                                  every rank sees this folder (`launch`), then removed

Every name is here, so the trainer, `rlmtrain eval`, `rlmtrain rollout`, the checkpoints and the
run log cannot drift apart on where a file is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from rlmtrain.config import Config, ConfigError

Split = Literal["sft", "rl", "eval"]


class RunFolder:
    """The layout under one run folder; makes nothing until `make`."""

    def __init__(self, root: str | Path, metrics_path: str | Path = "") -> None:
        self.root = Path(root)
        self.metrics = Path(metrics_path) if metrics_path else self.root / "metrics.jsonl"
        self._metrics_elsewhere = bool(metrics_path)

    @classmethod
    def of(cls, cfg: Config) -> RunFolder:
        return cls(cfg.checkpoint.dir, cfg.logging.metrics_path)

    def data(self, split: Split) -> Path:
        return self.root / "data" / split

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def final(self) -> Path:
        return self.root / "final"

    @property
    def ranks(self) -> Path:
        return self.root / "ranks"

    def rank_note(self, rank: int) -> Path:
        return self.ranks / f"{rank}.json"

    @property
    def evals(self) -> Path:
        return self.root / "eval.jsonl"

    @property
    def samples(self) -> Path:
        return self.root / "samples.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def curves(self) -> Path:
        return self.root / "curves.png"

    def make(self) -> RunFolder:
        """The folder, made; refused at the start, in one line, where the run could not write
        what it makes (before hours of training end in a lost export)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"checkpoint.dir: cannot make {self.root}: {exc.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ConfigError(f"checkpoint.dir: {self.root} is not writable")
        if self.final.exists() and not self.final.is_dir():
            raise ConfigError(
                f"checkpoint.dir: {self.final}, where the trained model goes, is a file"
            )
        if self._metrics_elsewhere:
            if self.metrics.is_dir():
                raise ConfigError(
                    f"logging.metrics_path: {self.metrics} is a folder; name a .jsonl file"
                )
            try:
                self.metrics.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"logging.metrics_path: cannot make {self.metrics.parent}: {exc.strerror}"
                ) from None
        return self
