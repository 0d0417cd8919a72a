"""What `save_hf` writes loads in transformers with the same logits; sharded round trips; bad
checkpoints fail with errors naming the tensor and the file."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rlmtrain.config import ModelConfig
from rlmtrain.model import (
    CheckpointError,
    ModelArgs,
    RopeScaling,
    Transformer,
    build_model,
    load_hf,
    load_hf_tensors,
    named_hf_tensors,
    save_hf,
)

QWEN3_TIED = ModelArgs(
    family="qwen3",
    vocab_size=1000,
    hidden_size=96,
    intermediate_size=160,
    num_layers=2,
    num_heads=6,
    num_kv_heads=3,
    head_dim=16,
    rope_theta=1_000_000.0,
    qk_norm=True,
    tie_word_embeddings=True,
)
LLAMA = ModelArgs(
    family="llama",
    vocab_size=1000,
    hidden_size=96,
    intermediate_size=160,
    num_layers=2,
    num_heads=6,
    num_kv_heads=3,
    head_dim=16,
    rope_theta=500_000.0,
    rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    ),
    rms_norm_eps=1e-5,
)


def random_model(args: ModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args, attention="sdpa")
    model.init_weights(seed, std=0.05)
    with torch.no_grad():  # non-unit norm scales, so a swapped or dropped norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(
                    0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
                )
    return model


def tokens(n: int = 40) -> torch.Tensor:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(2))


def our_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(ids, torch.arange(ids.numel()), torch.tensor([0, ids.numel()]))
        return hidden @ model.lm_head_weight.T


@pytest.mark.parametrize("args", [QWEN3_TIED, LLAMA], ids=["qwen3-tied", "llama-rope-scaled"])
def test_saved_checkpoint_loads_in_transformers_with_same_logits(tmp_path, args):
    model = random_model(args)
    save_hf(model, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    )
    ids = tokens()
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0]
    assert (our_logits(model, ids) - ref).abs().max().item() <= 1e-4
    assert {name for name, _ in named_hf_tensors(model)} == set(hf_model.state_dict()) - (
        {"lm_head.weight"} if args.tie_word_embeddings else set()
    )


def test_sharded_round_trip(tmp_path):
    model = random_model(LLAMA)
    save_hf(model, tmp_path, max_shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for _, t in named_hf_tensors(model))

    loaded = load_hf(tmp_path)
    for (name, a), (_, b) in zip(named_hf_tensors(model), named_hf_tensors(loaded), strict=True):
        assert torch.equal(a, b), name
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf_model(tokens()[None]).logits[0]
    assert (our_logits(loaded, tokens()) - ref).abs().max().item() <= 1e-4


def test_resaving_single_file_replaces_old_shards(tmp_path):
    model = random_model(QWEN3_TIED)
    save_hf(model, tmp_path, max_shard_bytes=200_000)
    save_hf(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_hf(tmp_path).embed_tokens.weight, model.embed_tokens.weight)


def test_bfloat16_save_records_dtype(tmp_path):
    model = random_model(QWEN3_TIED).to(torch.bfloat16)
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_hf(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(loaded.layers[1].mlp.up_proj.weight, model.layers[1].mlp.up_proj.weight)


def test_build_model_loads_hf_dir(tmp_path):
    save_hf(random_model(LLAMA), tmp_path)
    model = build_model(ModelConfig(hf_dir=str(tmp_path), attention="sdpa"))
    assert model.args == LLAMA
    assert torch.equal(model.lm_head.weight, random_model(LLAMA).lm_head.weight)


def test_load_hf_tensors_updates_a_live_model():
    source, target = random_model(LLAMA, seed=1), random_model(LLAMA, seed=2)
    names = load_hf_tensors(target, named_hf_tensors(source))
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert torch.equal(our_logits(source, tokens()), our_logits(target, tokens()))


def test_unknown_tensor_names_itself_and_source():
    model = random_model(LLAMA)
    with pytest.raises(
        CheckpointError, match=r"sync: unknown tensor 'model.layers.9.mlp.up_proj.weight'"
    ):
        load_hf_tensors(
            model, [("model.layers.9.mlp.up_proj.weight", torch.zeros(1))], source="sync"
        )


def test_shape_mismatch_names_tensor_and_file(tmp_path):
    save_hf(random_model(LLAMA), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 96)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_hf(tmp_path)
    message = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in message and str(path) in message
    assert "(16, 96)" in message and "(48, 96)" in message


def test_missing_tensor_names_itself(tmp_path):
    save_hf(random_model(QWEN3_TIED), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match="missing tensor 'model.layers.1.self_attn.k_norm.weight'"
    ):
        load_hf(tmp_path)


def test_corrupt_file_names_the_file(tmp_path):
    save_hf(random_model(QWEN3_TIED), tmp_path, max_shard_bytes=200_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{shard}: unreadable safetensors file"):
        load_hf(tmp_path)


def test_config_mismatch_is_caught(tmp_path):
    save_hf(random_model(QWEN3_TIED), tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["intermediate_size"] = 128
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj\.weight' has shape"):
        load_hf(tmp_path)
    config_path.write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(
        CheckpointError, match=f"{config_path}: model_type 'mistral' is not supported"
    ):
        load_hf(tmp_path)


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path):
    save_hf(random_model(QWEN3_TIED), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    load_hf(tmp_path)  # an exporter writing both copies is fine
    tensors["lm_head.weight"] += 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="differs from model.embed_tokens.weight"):
        load_hf(tmp_path)


def test_missing_weights_and_config_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(tmp_path)
    save_hf(random_model(QWEN3_TIED), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": "96"}, r"does not describe a model: Expected `int`, got `str`"),
        ({"hidden_size": None}, r"Expected `int`, got `null`"),
        ({"hidden_size": -96}, r"hidden_size must be >= 1"),
        ({"num_hidden_layers": 0}, r"num_layers must be >= 1"),
        ({"num_key_value_heads": 4}, r"not a multiple of num_kv_heads=4"),
        ({"num_attention_heads": 4.5}, r"Expected `int`, got `float`"),
        ({"num_attention_heads": 0, "head_dim": None}, r"does not describe a model"),
        ({"rope_theta": "abc"}, r"Expected `float`, got `str`"),
        ({"rope_scaling": {"rope_type": "llama3"}}, r"rope_scaling\.factor"),
        ({"rope_scaling": [1]}, r"rope_scaling is not an object"),
        ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a positive number, got nan"),
    ],
)
def test_a_config_json_value_that_builds_no_model_is_named(tmp_path, change, message):
    """Each was a TypeError, ZeroDivisionError, KeyError or ValueError from deep in the
    model's construction, on the training and rollout paths (eval caught some of them)."""
    save_hf(random_model(QWEN3_TIED), tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **change}))
    with pytest.raises(CheckpointError, match=f"{config_path}: .*{message}"):
        load_hf(tmp_path)


@pytest.mark.parametrize("content", [b"[1]", b"\xff\xfe", b'"a model"'])
def test_a_config_json_that_is_no_json_object_is_named(tmp_path, content):
    save_hf(random_model(QWEN3_TIED), tmp_path)
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'config.json'}: "):
        load_hf(tmp_path)


def test_a_config_json_far_larger_than_its_weights_is_refused_before_allocating(tmp_path):
    """vocab_size 1e12 would ask for terabytes before a weight is read."""
    save_hf(random_model(QWEN3_TIED), tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "vocab_size": 10**12})
    )
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight' has shape \(1000, 96\), but"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"[1, 2]", "its header is not an object"),
        (b'{"w": {"dtype": "F32", "shape": 5, "data_offsets": [0, 4]}}', "malformed header"),
    ],
)
def test_a_safetensors_header_that_is_no_header_is_named(tmp_path, header, message):
    save_hf(random_model(QWEN3_TIED), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    with pytest.raises(CheckpointError, match=f"{weights}: .*{message}"):
        load_hf(tmp_path)


def test_a_safetensors_length_past_the_file_is_not_read(tmp_path):
    """Random bytes: the first eight read as a header length of exabytes (a MemoryError)."""
    save_hf(random_model(QWEN3_TIED), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\xff" * 4096)
    with pytest.raises(CheckpointError, match="its header would end past the file"):
        load_hf(tmp_path)
