"""Linear weights stored packed (`compile --weights int8|int4`): the artifact's smallest form.

The block projections and the vocabulary head are stored as int8 / int4 blocks
(kernels/int_weights.py; the int4 level keeps the head at int8) in weights-LEVEL.safetensors,
which the manifest lists with its sha256 like every file; the rest stays in weights.safetensors.
Loading dequantizes the blocks into the tensors the generated module reads, so every executor
runs them. Where the source's weights were already such blocks (a GGUF Q4_1 / Q8_0 file) the
dequantized values are the source's exactly and the full path still equals the source model;
the manifest's `packed_weights` records the largest change of any weight either way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rbcompile.errors import UserError

if TYPE_CHECKING:
    from rbcompile.kernels.int_weights import PackedWeight

LAYOUT_KEY = "rbcompile_packing"   # safetensors metadata: key -> [bits, block, out, in]
HEAD = "lm_head.weight"


def level_precision(level: str, linears: list[str]) -> dict[str, str] | None:
    """The precision per linear weight of a level (None: fp32). int4 keeps the vocabulary head
    at int8, as llama.cpp's 4-bit files keep their output tensor at 6-8 bits: the head is
    21% of SmolLM2's weights and the one most sensitive (a GGUF Q4_1 SmolLM2 ships it Q8_0).
    int4-fp32 keeps it fp32: MatMulNBits with fp32 activations has no fast int8 kernel here."""
    if level == "fp32":
        return None
    if level == "int4-fp32":
        return {key: level for key in linears if key != HEAD}
    return {key: "int8" if level == "int4" and key == HEAD else level for key in linears}


def prefill_precision(level: str, linears: list[str]) -> dict[str, str] | None:
    """The precision per linear weight of a prefill level (None: fp32). "int8" quantizes every
    block linear's activations per token; the head stays fp32 (a prefill computes it on the
    last position only, unless the prompt itself is scored)."""
    if level == "fp32":
        return None
    return {key: "int8-token" for key in linears if key != HEAD}


def packed_file(level: str) -> str:
    """The file an artifact stores its linears in at `level`."""
    return f"weights-{level}.safetensors"


def unmeasure(manifest: dict) -> None:
    """Calibration measured the weights before packing changed them: every plan but the full
    path becomes unmeasured (lossless-only unless the user opts in), the measured precision
    levels, the prefill levels and each plan's losses at them are dropped."""
    manifest.pop("precisions", None)
    manifest.pop("prefill_precisions", None)
    if manifest.get("plans"):
        manifest["plans"] = [plan if plan["budget"] == 0 else
                             {**{key: value for key, value in plan.items()
                                 if key != "precision_losses"},
                              "quality_loss": None, "decoder_quality_loss": None}
                             for plan in manifest["plans"]]


def linear_keys(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The weights a level packs: every 2-D projection and the vocabulary head."""
    return [key for key, tensor in tensors.items()
            if tensor.dim() == 2 and (key.endswith("_proj.weight") or key == HEAD)]


@dataclass(frozen=True)
class PackedWeights:
    """The manifest's `packed_weights`: the level, its file and the largest absolute change
    any weight took (0: the source's values exactly)."""
    level: str
    file: str
    max_abs_error: float

    def to_json(self) -> dict:
        return {"level": self.level, "file": self.file, "max_abs_error": self.max_abs_error}


def pack(tensors: dict[str, torch.Tensor], level: str,
         loaded: dict[str, PackedWeight] | None = None
         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str], PackedWeights]:
    """(the tensors left at full precision, the packed parts, their safetensors metadata, the
    manifest entry) for storing `tensors` at `level`. A weight that is still the dequantized
    value of its `loaded` blocks keeps them (quantizing it again may move a scale by an ulp)."""
    from rbcompile.kernels.int_weights import LEVELS, dequantize, quantize

    if level not in LEVELS:
        raise UserError(f"--weights must be fp32 or one of {', '.join(LEVELS)}, got {level}")
    levels = level_precision(level, linear_keys(tensors))
    parts, layout, error = {}, {}, 0.0
    for key, key_level in levels.items():
        original, packed = tensors[key], (loaded or {}).get(key)
        if packed is None or packed.bits != LEVELS[key_level] or not torch.equal(
                dequantize(packed).to(original.dtype), original):
            packed = quantize(original.float(), LEVELS[key_level])
        error = max(error, float((dequantize(packed).to(original.dtype).float()
                                  - original.float()).abs().max()))
        layout[key] = [packed.bits, packed.block_size, packed.out_features, packed.in_features]
        parts[f"{key}.data"] = torch.from_numpy(packed.data)
        parts[f"{key}.scales"] = torch.from_numpy(packed.scales)
        if packed.offsets is not None:
            parts[f"{key}.offsets"] = torch.from_numpy(packed.offsets)
    rest = {key: tensor for key, tensor in tensors.items() if key not in levels}
    return (rest, parts, {LAYOUT_KEY: json.dumps(layout)},
            PackedWeights(level, packed_file(level), error))


def unpack(path: Path) -> dict[str, PackedWeight]:
    """The packed weights of a file (its sha256 already verified)."""
    from safetensors import safe_open

    from rbcompile.kernels.int_weights import PackedWeight

    try:
        with safe_open(str(path), framework="pt") as handle:
            layout = json.loads((handle.metadata() or {})[LAYOUT_KEY])
            parts = {key: handle.get_tensor(key) for key in handle.keys()}
        packed = {}
        for key, (bits, block, out_features, in_features) in layout.items():
            offsets = parts.get(f"{key}.offsets")
            packed[key] = PackedWeight(
                parts[f"{key}.data"].numpy(), parts[f"{key}.scales"].numpy(), bits, block,
                out_features, in_features, None if offsets is None else offsets.numpy())
    except (KeyError, ValueError, TypeError, OSError) as exc:
        raise UserError(f"corrupt packed weights {path}: {type(exc).__name__}: {exc}") from None
    return packed
