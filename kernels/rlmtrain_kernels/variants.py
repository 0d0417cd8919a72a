"""Which Triton path each stage of the LM-head ops takes, chosen per call.

Every op takes `variants=Variants(...)` (None: `Variants()`, the measured winners) the way it
takes `impl`: nothing about the choice lives in a module, so one caller's choice never reaches
another's call, and the choice is an argument of the custom ops, a constant torch.compile sees
and keys its graphs on. The ops pass it down as `Variants.spec`, a string, since a custom op's
arguments are tensors and scalars; `Variants.from_spec` reads it back (cached).

The choices only select among the Triton paths: the torch backend has one path, which ignores
them, so device-agnostic code can pass the same variants everywhere.

The defaults and the figures behind them, all on an H200 at N = 16384, H = 2560, V = 151936 in
bf16 (bench/gpu/NOTES.md; bench/gpu/sweep_tiles.py and profile_head.py time the alternatives):

- forward: "stored" (a slab's fp32 logits by a matrix product, then a Triton pass per row;
  logit_slabs.py) took 21.9 ms against 25.5 for "kernel" (the Triton GEMM tile with an online
  log-sum-exp, nothing of size V stored).
- backward: "stored" (the slab's logits by a matrix product, its gradients by a pass per row)
  60.6 ms; "slabs" (a Triton GEMM writes a bounded slab of logit gradients, two matrix products
  finish dX and dW; logprob_slabs.py) 62.1-63.4; "atomic" (each logit tile adds its products
  into fp32 buffers with atomics, nothing of size V stored) 153.7-155.6, bound by the atomics'
  L2 read-modify-write traffic.
- row_grads, the fused losses: "stored" (each slab's logits formed once and kept in fp32 for its
  gradients: 6·N·H·V) 63.4 ms against 90.4 for "recompute" (the log-prob forward, then the
  backward forming the logits again: 8·N·H·V).
- logprob_slabs: "rows" (each slab all V columns of some rows; its backward adds each slab's
  dz^T X into the fp32 dW) or "columns" (each slab all N rows of some vocabulary columns, merged
  by log-sum-exp; its backward writes each slab's rows of dW once and adds into the fp32 dX).
  Columns move less memory while N < V. The fused losses need whole rows (a token's gradient
  needs its log-prob) and always cut rows.

The "stored" choices take 16-bit inputs only: fp32 inputs keep the kernels' exact ("ieee") dots,
which a cuBLAS product does not promise (it may use TF32 where the caller allowed it). fp32
inputs asking for a stored forward take the kernel, a stored backward the slabs, stored row
gradients the recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["STORED_LOGITS_DTYPES", "TILED_KERNELS", "Variants"]

# Each choice and what it may be (the default first).
CHOICES = {
    "forward": ("stored", "kernel"),
    "backward": ("stored", "slabs", "atomic"),
    "row_grads": ("stored", "recompute"),
    "logprob_slabs": ("rows", "columns"),
}
SLAB_BOUNDS = ("logit_slab_bytes", "grad_slab_bytes")
# The Triton GEMM kernels whose tile shapes a caller may set (`Variants.tiles`): the log-prob
# forward ("kernel"), the atomic backward, and the slab backward's logit-gradient kernel; the
# blocks each one's shape must give.
TILE_BLOCKS = {
    "forward": {"BLOCK_N", "BLOCK_V", "BLOCK_H"},
    "backward": {"BLOCK_N", "BLOCK_V", "BLOCK_H", "BLOCK_H_OUT"},
    "dlogits": {"BLOCK_N", "BLOCK_V", "BLOCK_H"},
}
TILED_KERNELS = tuple(TILE_BLOCKS)
LAUNCH_OPTIONS = {"num_warps", "num_stages"}
STORED_LOGITS_DTYPES = (torch.bfloat16, torch.float16)

# The fields a spec spells, in its order (then the tile shapes).
SPEC_FIELDS = (*CHOICES, *SLAB_BOUNDS)
TileShapes = tuple[tuple[str, tuple[tuple[str, int], ...]], ...]


@dataclass(frozen=True)
class Variants:
    """The Triton paths of one call. See the module docstring for what each choice does.

    forward: "stored" | "kernel"; backward: "stored" | "slabs" | "atomic"; row_grads (the fused
    losses): "stored" | "recompute"; logprob_slabs (the log-prob op's stored slabs): "rows" |
    "columns". logit_slab_bytes bounds one slab of fp32 logits (stored paths: 2 GiB is 3,533 rows
    at V = 151936; each row slab reads and writes the fp32 dW once, so fewer, larger slabs save
    that traffic); grad_slab_bytes one slab of 16-bit logit gradients ("slabs" backward).
    tiles: {kernel: {BLOCK_N: ..., BLOCK_V: ..., ...}} replaces the tile shape and launch options
    of a kernel in TILED_KERNELS on whatever device and dtype the call runs (a tuning sweep's
    candidate); kernels not named keep `tiles.tiles_for`'s.
    """

    forward: str = "stored"
    backward: str = "stored"
    row_grads: str = "stored"
    logprob_slabs: str = "rows"
    logit_slab_bytes: int = 2 << 30
    grad_slab_bytes: int = 1 << 30
    tiles: Mapping[str, Mapping[str, int]] | TileShapes = ()

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"Variants.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        for name in SLAB_BOUNDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Variants.{name} must be a positive int, got {value!r}")
        # Kept as sorted pairs, so that equal choices are equal, hashable and spelled one way.
        object.__setattr__(self, "tiles", _tile_shapes(self.tiles))
        # Spelled out once, by plain string operations, which Dynamo traces (a Variants made
        # inside a compiled function; json's encoder it does not), as `name=value;...`.
        choices = [f"{name}={getattr(self, name)}" for name in SPEC_FIELDS]
        choices += [
            f"tiles.{kernel}.{key}={value}" for kernel, shape in self.tiles for key, value in shape
        ]
        object.__setattr__(self, "_spec", ";".join(choices))

    def tile_shape(self, kernel: str) -> dict[str, int] | None:
        """The caller's tile shape for `kernel`, or None to take the default."""
        shape = dict(self.tiles).get(kernel)
        return dict(shape) if shape is not None else None

    def stores_logits(self, stage: str, dtype: torch.dtype) -> bool:
        """Whether `stage` ("forward", "backward" or "row_grads") takes the stored-logits path
        for inputs of this dtype: it asks for "stored" and the dtype is 16-bit."""
        return getattr(self, stage) == "stored" and dtype in STORED_LOGITS_DTYPES

    @property
    def spec(self) -> str:
        """These choices as the string the custom ops carry (`from_spec` reads it back)."""
        return self._spec

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def from_spec(spec: str) -> Variants:
        choices: dict = {}
        tiles: dict[str, dict[str, int]] = {}
        for choice in spec.split(";"):
            name, value = choice.split("=")
            if name.startswith("tiles."):
                _, kernel, key = name.split(".")
                tiles.setdefault(kernel, {})[key] = int(value)
            else:
                choices[name] = int(value) if name in SLAB_BOUNDS else value
        return Variants(**choices, tiles=tiles)


def _tile_shapes(tiles: Mapping[str, Mapping[str, int]] | TileShapes) -> TileShapes:
    pairs = tiles.items() if isinstance(tiles, Mapping) else tiles
    shapes = []
    for kernel, shape in pairs:
        if kernel not in TILED_KERNELS:
            raise ValueError(f"Variants.tiles: no kernel {kernel!r} (tiled: {TILED_KERNELS})")
        items = tuple(shape.items() if isinstance(shape, Mapping) else shape)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for _, v in items):
            raise ValueError(f"Variants.tiles[{kernel!r}]: every entry must be a positive int")
        # tl.arange takes power-of-two ranges, tl.dot operands of at least 16 a side; Triton
        # launches a power-of-two number of warps. Refused here, not deep inside a compile.
        odd = [(key, v) for key, v in items if not _launchable(key, v)]
        if odd:
            raise ValueError(
                f"Variants.tiles[{kernel!r}]: BLOCK_* must be powers of two >= 16 and num_warps "
                f"a power of two, got {dict(odd)}"
            )
        keys, blocks = {key for key, _ in items}, TILE_BLOCKS[kernel]
        if not blocks <= keys <= blocks | LAUNCH_OPTIONS:
            raise ValueError(
                f"Variants.tiles[{kernel!r}] must give {sorted(blocks)} (and may give "
                f"{sorted(LAUNCH_OPTIONS)}), got {sorted(keys)}"
            )
        shapes.append((kernel, tuple(sorted(items))))
    return tuple(sorted(shapes))


def _launchable(key: str, value: int) -> bool:
    power_of_two = value & (value - 1) == 0
    if key.startswith("BLOCK"):
        return power_of_two and value >= 16
    return power_of_two if key == "num_warps" else True


DEFAULT = Variants()


def resolve(variants: Variants | None) -> Variants:
    """A call's variants: the caller's, or the defaults; anything else is refused."""
    if variants is None:
        return DEFAULT
    if not isinstance(variants, Variants):
        raise TypeError(f"variants must be a rlmtrain_kernels.Variants, got {variants!r}")
    return variants
