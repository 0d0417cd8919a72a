"""One typed config tree for every rlmtrain command.

Each section is a msgspec Struct whose fields carry a default and a one-line description
(`msgspec.Meta(description=...)`), so the same source gives validation, `rlmtrain config show`
and the README's reference. A run file is TOML; `--section.key=value` arguments override it,
the value parsed as a TOML literal (a bare word that is not one stays a string).

Errors never surface as tracebacks: an unknown key, a wrong type, an out-of-range value or a
missing file raises `ConfigError` with one line that names the key and the file; the CLI prints
it and exits with code 2.
"""

from rlmtrain.config.loader import (
    apply_overrides,
    field_docs,
    load_config,
    reference_markdown,
    split_overrides,
    to_toml,
)
from rlmtrain.config.rules import preflight, too_few_workers
from rlmtrain.config.schema import (
    ROLLOUT_DEFAULTS,
    SECTIONS,
    SEED_MAX,
    AlgoConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    JudgeConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    TrainConfig,
)

__all__ = [
    "ROLLOUT_DEFAULTS",
    "SECTIONS",
    "SEED_MAX",
    "AlgoConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "JudgeConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "RolloutConfig",
    "TrainConfig",
    "apply_overrides",
    "field_docs",
    "load_config",
    "preflight",
    "reference_markdown",
    "split_overrides",
    "to_toml",
    "too_few_workers",
]
