"""The policy built shard by shard (`training.materialise`): the same weights, bit for bit, as
building the whole model and sharding it, from the seeded init and from a checkpoint in either
dtype; and a checkpoint that does not fit refused in one line naming the tensor.

Two ranks that each hold half (and the memory that saves) are `tests/test_distributed.py`'s.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from rlmtrain import parallel
from rlmtrain.config import ModelConfig
from rlmtrain.model import CheckpointError, RowReader, build_model, save_hf
from rlmtrain.training.materialise import sharded_policy

CPU = torch.device("cpu")
TINY = ModelConfig(preset="tiny", vocab_size=300, seed=5)


@pytest.fixture(autouse=True)
def world():
    parallel.start("cpu")
    yield
    parallel.stop()


def _equal(whole: torch.nn.Module, sharded: torch.nn.Module) -> list[str]:
    """Names whose values differ; [] when every parameter is equal bit for bit."""
    theirs = parallel.full_state(sharded)
    ours = dict(whole.named_parameters())
    assert ours.keys() == theirs.keys()
    return [name for name in ours if not torch.equal(ours[name], theirs[name])]


def test_the_seeded_init_equals_the_whole_models():
    assert _equal(build_model(TINY), sharded_policy(TINY, CPU, torch.float32)) == []
    other_seed = msgspec.structs.replace(TINY, seed=6)
    assert _equal(build_model(TINY), sharded_policy(other_seed, CPU, torch.float32)) != []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_loads_as_the_whole_model_loads_it(tmp_path, dtype):
    save_hf(build_model(TINY), tmp_path, dtype=dtype, max_shard_bytes=200_000)  # several files
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    cfg = msgspec.structs.replace(TINY, hf_dir=str(tmp_path))
    whole = build_model(msgspec.structs.replace(cfg, dtype="float32"))
    assert _equal(whole, sharded_policy(cfg, CPU, torch.float32)) == []


def test_rows_are_read_from_the_middle_of_a_tensor(tmp_path):
    save_hf(build_model(TINY), tmp_path)
    reader = RowReader(tmp_path)
    name = "model.embed_tokens.weight"
    full = load_file(tmp_path / "model.safetensors")[name]
    assert torch.equal(reader.read_rows(name, slice(7, 11)), full[7:11])
    assert reader.read_rows(name, slice(3, 3)).shape == (0, full.shape[1])


def _one_file_state(tmp_path) -> dict[str, torch.Tensor]:
    save_hf(build_model(TINY), tmp_path)
    return load_file(tmp_path / "model.safetensors")


def _rewrite(tmp_path, state) -> None:
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_a_tied_head_copy_that_differs_is_refused(tmp_path):
    state = _one_file_state(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"]
    _rewrite(tmp_path, {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()})
    cfg = msgspec.structs.replace(TINY, hf_dir=str(tmp_path))
    sharded_policy(cfg, CPU, torch.float32)  # an equal copy is accepted
    _rewrite(tmp_path, {**state, "lm_head.weight": state["model.embed_tokens.weight"] + 1})
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from model.embed_tokens"):
        sharded_policy(cfg, CPU, torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop", r"missing tensor 'model\.layers\.0\.mlp\.up_proj\.weight' \(1 missing in all\)"),
        ("add", r"unknown tensor 'model\.layers\.9\.mlp\.up_proj\.weight'"),
        ("reshape", r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape"),
        ("truncate", r"ends past the file \(truncated file\)"),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_tensor(tmp_path, change, message):
    state = _one_file_state(tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    if change == "drop":
        del state[name]
    elif change == "add":
        state["model.layers.9.mlp.up_proj.weight"] = state[name].clone()
    elif change == "reshape":
        state[name] = state[name][:-1]
    if change != "truncate":
        _rewrite(tmp_path, state)
    else:
        path = tmp_path / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
    cfg = msgspec.structs.replace(TINY, hf_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match=message):
        sharded_policy(cfg, CPU, torch.float32)


def test_a_config_json_far_larger_than_its_weights_is_refused_before_any_shard(tmp_path):
    """Checked on the meta skeleton: vocab_size 1e12 would otherwise allocate its shards first."""
    save_hf(build_model(TINY), tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "vocab_size": 10**12})
    )
    cfg = msgspec.structs.replace(TINY, hf_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight' has shape \(300, "):
        sharded_policy(cfg, CPU, torch.float32)
