"""The policy on the ranks, with no whole copy of it anywhere: built on the meta device, sharded,
given storage for each rank's own shards, then filled shard by shard.

A rank fills its rows of each parameter either from the checkpoint (`model.hf_dir`), reading
those rows alone from the safetensors files (`model.RowReader`), or from the same seeded values
`Transformer.init_weights` gives a whole model, one whole parameter at a time. So a rank's memory
peaks at its shards plus one parameter, where building the model first and sharding it after
held the whole fp32 model on every rank (and on every GPU) before a byte was freed; and the
weights equal those of the whole-model path, bit for bit, at any number of ranks.
"""

from __future__ import annotations

import torch

from rlmtrain import parallel
from rlmtrain.config import ModelConfig
from rlmtrain.model import CheckpointError, RowReader, Transformer, model_skeleton
from rlmtrain.model.hf import TIED_HEAD, named_hf_tensors, tied_copy_differs


def sharded_policy(
    cfg: ModelConfig, device: torch.device, compute_dtype: torch.dtype, replicate: int = 1
) -> Transformer:
    """`cfg`'s model sharded over the world (`parallel.shard`), fp32 masters, each rank's shards
    loaded from `cfg.hf_dir` or initialised from `cfg.seed`."""
    skeleton = model_skeleton(cfg)
    reader = RowReader(cfg.hf_dir) if cfg.hf_dir else None
    if reader is not None:
        # On the meta skeleton, before any shard has storage: a config.json that describes a
        # far larger model than its weights must not be allocated first.
        _check_rows(skeleton, reader)
    model = parallel.shard(skeleton, device, compute_dtype, replicate)
    with torch.no_grad():
        if reader is not None:
            _load_rows(model, reader)
        else:
            params = dict(model.named_parameters())
            for name, values in model.initial_values(cfg.seed):
                parallel.local_shard(params[name]).copy_(values[parallel.local_rows(params[name])])
    return model


def sharded_like(
    model: Transformer, device: torch.device, compute_dtype: torch.dtype
) -> Transformer:
    """A model of `model`'s shape sharded as it is, its shards given storage and left unset: for
    a copy whose weights are loaded next (the KL reference)."""
    with torch.device("meta"):
        skeleton = Transformer(
            model.args,
            attention=model.attention,
            activation_checkpointing=model.activation_checkpointing,
            compile_layers=model.compile_layers,
        )
    mesh = next(model.parameters()).device_mesh  # type: ignore[attr-defined]
    replicate = mesh.size(0) if mesh.ndim == 2 else 1
    return parallel.shard(skeleton, device, compute_dtype, replicate)


def _check_rows(model: Transformer, reader: RowReader) -> None:
    """The checkpoint holds every parameter of `model` in its shape, and nothing else."""
    source = str(reader.directory)
    expected = dict(named_hf_tensors(model))
    present = reader.names()
    unknown = sorted(present - set(expected) - {TIED_HEAD})
    if unknown:
        raise CheckpointError(
            f"{source}: unknown tensor {unknown[0]!r} (not a parameter of this model)"
        )
    missing = sorted(set(expected) - present)
    if missing:
        raise CheckpointError(
            f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all)"
        )
    for hf_name, parameter in expected.items():
        if reader.shape(hf_name) != tuple(parameter.shape):
            raise CheckpointError(
                f"{source}: tensor {hf_name!r} has shape {reader.shape(hf_name)}, "
                f"the model expects {tuple(parameter.shape)}"
            )


def _load_rows(model: Transformer, reader: RowReader) -> None:
    """Each rank's rows of every parameter from the checkpoint (`_check_rows` passed). A tied
    head the checkpoint also holds must equal the embedding; each rank compares its own rows
    and every rank learns the verdict, so all of them raise together rather than some waiting
    in a collective."""
    expected = dict(named_hf_tensors(model))
    for hf_name, parameter in expected.items():
        parallel.local_shard(parameter).copy_(
            reader.read_rows(hf_name, parallel.local_rows(parameter))
        )
    differs = False
    if TIED_HEAD in reader.names() and TIED_HEAD not in expected:
        embedding = model.embed_tokens.weight
        # The shapes first: rows of a head of another shape may not exist on every rank.
        differs = reader.shape(TIED_HEAD) != tuple(embedding.shape) or not torch.equal(
            reader.read_rows(TIED_HEAD, parallel.local_rows(embedding)).to(torch.float32),
            parallel.local_shard(embedding).cpu(),
        )
    if any(parallel.all_gather(differs)):
        raise tied_copy_differs(str(reader.directory))
