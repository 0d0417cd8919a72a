"""Hugging Face checkpoints: `config.json` + safetensors, in Hugging Face parameter names.

What we save, transformers' `from_pretrained` and vLLM load, and we load what they publish:
- config: `model_type` "qwen3" or "llama" with the usual keys. We write RoPE as `rope_theta` +
  `rope_scaling` (the form every published Qwen3/Llama-3 config uses and every loader reads) and
  read both that and transformers 5's `rope_parameters`.
- weights: `model.safetensors`, or above `max_shard_bytes` the shards
  `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`
  (`{"metadata": {"total_size"}, "weight_map": {name: file}}`); loading reads either.
- names: our modules already carry Hugging Face's names under `model.` (`transformer.py`), so the
  mapping is a prefix; with tied embeddings there is no `lm_head.weight` (a checkpoint that has
  one anyway is accepted when it equals the embedding, as some exporters write both).

Every mismatch is an error naming the tensor and the file: unknown or missing names, wrong shapes,
unreadable files. `named_hf_tensors` / `load_hf_tensors` are the same mapping for weight sync to a
running engine.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from rlmtrain.errors import UserError
from rlmtrain.model.presets import ModelArgs, RopeScaling
from rlmtrain.model.transformer import Transformer

__all__ = [
    "TIED_HEAD",
    "CheckpointError",
    "RowReader",
    "args_from_hf_config",
    "hf_config",
    "hf_named",
    "load_hf",
    "load_hf_tensors",
    "named_hf_tensors",
    "read_hf_args",
    "save_hf",
    "tied_copy_differs",
    "write_hf_config",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
TIED_HEAD = "lm_head.weight"
"""The head's name in a checkpoint: with tied embeddings not a parameter, though some exporters
write it; accepted when it equals the embedding (`tied_copy_differs` otherwise)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that does not match the model; the message names the tensor and the file."""


# -- names -------------------------------------------------------------------------------------


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _our_name(hf_name: str) -> str | None:
    if hf_name.startswith("lm_head."):
        return hf_name
    return hf_name.removeprefix("model.") if hf_name.startswith("model.") else None


def named_hf_tensors(model: Transformer) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, detached parameter) for every parameter, embedding first."""
    return hf_named(model.named_parameters())


def hf_named(named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, detached tensor) for (our parameter name, tensor) pairs, lazily."""
    for name, tensor in named:
        yield _hf_name(name), tensor.detach()


def load_hf_tensors(
    model: Transformer, named: Iterable[tuple[str, Tensor]], *, source: str = "tensors"
) -> set[str]:
    """Copy (Hugging Face name, tensor) pairs into `model` in place; the names copied.

    A partial set is fine (weight sync may stream); unknown names and shape mismatches raise
    `CheckpointError` naming the tensor and `source`.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tied_copy = None
    with torch.no_grad():
        for hf_name, tensor in named:
            ours = _our_name(hf_name)
            if ours == TIED_HEAD and model.lm_head is None:
                tied_copy = tensor  # compared once the embedding itself has arrived
                continue
            if ours not in params:
                raise CheckpointError(
                    f"{source}: unknown tensor {hf_name!r} (not a parameter of this model)"
                )
            target = params[ours]
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(hf_name)
    if tied_copy is not None:
        _check_tied_duplicate(model, tied_copy, source)
    return loaded


def _check_tied_duplicate(model: Transformer, tensor: Tensor, source: str) -> None:
    embedding = model.embed_tokens.weight
    if tuple(tensor.shape) != tuple(embedding.shape) or not torch.equal(
        tensor.to(embedding), embedding.detach()
    ):
        raise tied_copy_differs(source)


def tied_copy_differs(source: str) -> CheckpointError:
    """The error for a checkpoint whose head copy is not the embedding it should be tied to."""
    return CheckpointError(
        f"{source}: {TIED_HEAD!r} differs from model.embed_tokens.weight but the config ties them"
    )


# -- config ------------------------------------------------------------------------------------


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """The `config.json` dict of a model with these args, stored in `dtype`."""
    scaling = None
    if args.rope_scaling is not None:
        scaling = {
            "rope_type": "llama3",
            **{f: getattr(args.rope_scaling, f) for f in RopeScaling.__struct_fields__},
        }
    return {
        "architectures": [_ARCHITECTURES[args.family]],
        "model_type": args.family,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def write_hf_config(args: ModelArgs, dtype: torch.dtype, directory: Path) -> None:
    """`directory/config.json` of a model with these args, stored in `dtype`."""
    (directory / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")


def args_from_hf_config(config: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """`ModelArgs` from a Qwen3 or Llama `config.json` dict; unsupported features raise."""
    family = config.get("model_type")
    if family not in _ARCHITECTURES:
        raise CheckpointError(
            f"{source}: model_type {family!r} is not supported (only qwen3, llama)"
        )
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if config.get(flag):
            raise CheckpointError(f"{source}: {flag}=true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"{source}: hidden_act {config['hidden_act']!r} is not supported (only silu)"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope_scaling is not an object")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("llama3", "default"):
        raise CheckpointError(
            f"{source}: rope type {rope_type!r} is not supported (only default, llama3)"
        )
    try:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim")
        if head_dim is None and isinstance(heads, int) and heads > 0:
            head_dim = config["hidden_size"] // heads
        # Converted, not just passed on: a string or a null where a size goes is named here
        # rather than failing as a comparison deep in the model's construction.
        args = msgspec.convert(
            {
                "family": family,
                "vocab_size": config["vocab_size"],
                "hidden_size": config["hidden_size"],
                "intermediate_size": config["intermediate_size"],
                "num_layers": config["num_hidden_layers"],
                "num_heads": heads,
                "num_kv_heads": config.get("num_key_value_heads") or heads,
                "head_dim": head_dim,
                "rope_theta": theta,
                "rope_scaling": (
                    {f: rope.get(f) for f in RopeScaling.__struct_fields__}
                    if rope_type == "llama3"
                    else None
                ),
                "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
                "tie_word_embeddings": config.get("tie_word_embeddings", False),
                "qk_norm": family == "qwen3",
                "max_position_embeddings": config.get("max_position_embeddings", 40960),
            },
            ModelArgs,
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing key {exc.args[0]!r}") from None
    except (msgspec.ValidationError, TypeError) as exc:
        raise CheckpointError(f"{source}: does not describe a model: {exc}") from None
    for name in ("rope_theta", "rms_norm_eps"):
        if not math.isfinite(getattr(args, name)) or getattr(args, name) <= 0:
            raise CheckpointError(
                f"{source}: {name} must be a positive number, got {getattr(args, name)}"
            )
    return args


# -- load / save -------------------------------------------------------------------------------


def read_hf_args(directory: str | Path) -> ModelArgs:
    """The `ModelArgs` of the checkpoint in `directory` (its config.json)."""
    config_path = Path(directory) / "config.json"
    try:
        config = json.loads(config_path.read_bytes().decode())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: no config.json in the checkpoint folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: unreadable or not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    return args_from_hf_config(config, str(config_path))


def load_hf(
    directory: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    attention: str = "auto",
    activation_checkpointing: bool = False,
    compile_layers: bool = False,
) -> Transformer:
    """A `Transformer` built from `directory`'s config.json and filled from its safetensors."""
    directory = Path(directory)
    args = read_hf_args(directory)
    with torch.device("meta"):
        model = Transformer(
            args,
            attention=attention,
            activation_checkpointing=activation_checkpointing,
            compile_layers=compile_layers,
        )
    _check_shapes(model, directory)
    model = model.to_empty(device="cpu").to(dtype)
    loaded: set[str] = set()
    tied_copies: list[tuple[Path, Tensor]] = []
    for path in _weight_files(directory):
        named = _read_safetensors(path)
        if args.tie_word_embeddings:  # the embedding may sit in a later shard than the copy
            named = _set_aside(named, TIED_HEAD, path, tied_copies)
        loaded |= load_hf_tensors(model, named, source=str(path))
    for path, tensor in tied_copies:
        _check_tied_duplicate(model, tensor, str(path))
    missing = sorted({name for name, _ in named_hf_tensors(model)} - loaded)
    if missing:
        raise CheckpointError(
            f"{directory}: missing tensor {missing[0]!r} ({len(missing)} missing in all)"
        )
    return model


def _check_shapes(model: Transformer, directory: Path) -> None:
    """Every parameter the weight files hold has the shape config.json gives it. Checked on the
    meta model, before any storage: a config.json describing a far larger model than its
    weights (a vocab_size off by a few digits) would otherwise be allocated first."""
    expected = {name: tuple(tensor.shape) for name, tensor in named_hf_tensors(model)}
    for path in _weight_files(directory):
        for name, entry in _safetensors_header(path).items():
            shape = tuple(entry["shape"])
            if name in expected and shape != expected[name]:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {shape}, but {directory}/config.json "
                    f"makes it {expected[name]}"
                )


class RowReader:
    """A checkpoint folder's tensors, read a range of rows at a time straight into a buffer of
    the caller's (plain reads; no memory map), so a rank that holds a shard of each parameter
    reads only its own rows and never holds, nor maps, the rest of the file."""

    _DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._where: dict[str, tuple[Path, int, torch.dtype, tuple[int, ...]]] = {}
        for path in _weight_files(self.directory):
            for name, entry in _safetensors_header(path).items():
                try:
                    dtype = self._DTYPES[entry["dtype"]]
                except KeyError:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} is {entry['dtype']}, not F32, BF16 or F16"
                    ) from None
                self._where[name] = (path, entry["start"], dtype, tuple(entry["shape"]))

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name][3]

    def read_rows(self, name: str, rows: slice) -> Tensor:
        """Rows `rows` of tensor `name` (all of a 0-d one) in the file's dtype, on the CPU."""
        path, start, dtype, shape = self._where[name]
        if not shape:
            shape, rows = (1,), slice(0, 1)
        count = rows.stop - rows.start
        out = torch.empty((count, *shape[1:]), dtype=dtype)
        row_bytes = out[0].numel() * out.element_size() if count else 0
        with open(path, "rb", buffering=0) as f:
            f.seek(start + rows.start * row_bytes)
            wanted = count * row_bytes
            view = memoryview(out.view(torch.uint8).numpy()).cast("B") if wanted else b""
            got = 0
            while got < wanted:
                n = f.readinto(view[got:])  # type: ignore[index]
                if not n:
                    raise CheckpointError(f"{path}: tensor {name!r} ends early (truncated file)")
                got += n
        return out


def _safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """{name: {dtype, shape, start}} of a safetensors file, `start` its first data byte."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if 8 + length > size:  # not read: the length of a damaged file may be anything
                raise CheckpointError(
                    f"{path}: unreadable safetensors file: its header would end past the file"
                )
            header = json.loads(f.read(length))
    except CheckpointError:
        raise
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not an object)")
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            if not all(isinstance(n, int) and n >= 0 for n in (begin, end, *entry["shape"])):
                raise ValueError
            entries[name] = {
                "dtype": entry["dtype"],
                "shape": entry["shape"],
                "start": 8 + length + begin,
            }
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if 8 + length + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ends past the file (truncated file)")
    return entries


def _weight_files(directory: Path) -> list[Path]:
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from None
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _set_aside(
    named: Iterable[tuple[str, Tensor]], name: str, path: Path, kept: list[tuple[Path, Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    """`named` without the tensor called `name`, which goes to `kept` with its file."""
    for item in named:
        if item[0] == name:
            kept.append((path, item[1]))
        else:
            yield item


def _read_safetensors(path: Path) -> Iterator[tuple[str, Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file: {exc}") from None


def save_hf(
    model: Transformer,
    directory: str | Path,
    *,
    state: Mapping[str, Tensor] | None = None,
    dtype: torch.dtype | None = None,
    generation: Mapping[str, Any] | None = None,
    extra_files: Iterable[Path] = (),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write config.json and the weights (sharded with an index above `max_shard_bytes`) of
    `model`, or of `state` (our parameter names -> whole tensors, e.g. gathered from shards)
    with `model`'s architecture, cast to `dtype` when given; `generation` becomes
    generation_config.json and `extra_files` (the tokenizer's) are copied in. The folder
    appears whole or not at all: written beside its place, then renamed into it."""
    directory = Path(directory)
    named = hf_named(state.items()) if state is not None else named_hf_tensors(model)
    tensors = [(name, t.to(dtype or t.dtype).contiguous().cpu()) for name, t in named]
    stored = tensors[0][1].dtype
    partial = directory.with_name(f".{directory.name}.partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    write_hf_config(model.args, stored, partial)
    if generation is not None:
        (partial / "generation_config.json").write_text(
            json.dumps(dict(generation), indent=2) + "\n"
        )
    for file in extra_files:
        shutil.copy2(file, partial / Path(file).name)
    shards: list[list[tuple[str, Tensor]]] = [[]]
    shard_bytes = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, tensor))
        shard_bytes += size
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(dict(shards[0]), str(partial / SINGLE_FILE), metadata=metadata)
    else:
        weight_map = {}
        for k, shard in enumerate(shards, start=1):
            filename = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(dict(shard), str(partial / filename), metadata=metadata)
            weight_map.update({name: filename for name, _ in shard})
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (partial / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    _replace_folder(partial, directory)


def _replace_folder(new: Path, target: Path) -> None:
    """Move the finished folder `new` into `target`'s place, retiring what was there."""
    if not target.is_dir():
        os.replace(new, target)
        return
    retired = target.with_name(f".{target.name}.old")
    if retired.exists():
        shutil.rmtree(retired)
    os.replace(target, retired)
    os.replace(new, target)
    shutil.rmtree(retired)
