"""Early-exit off-ramps as an artifact stores them: linear classifiers over the mean-pooled
stream after some layers, plus the task head and the exit threshold (trained and run by
runtime/early_exit.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

RAMP_FILE = "offramps.safetensors"


@dataclass
class OffRamps:
    layers: list[int]
    ramps: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (weight, bias)
    head: tuple[torch.Tensor, torch.Tensor]              # the task head on the full path
    threshold: float = 1.0

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"head.weight": self.head[0], "head.bias": self.head[1]}
        for layer, (weight, bias) in self.ramps.items():
            out[f"ramp{layer}.weight"], out[f"ramp{layer}.bias"] = weight, bias
        return {k: v.detach().contiguous() for k, v in out.items()}

    @classmethod
    def from_tensors(cls, tensors: dict, layers: list[int], threshold: float) -> "OffRamps":
        ramps = {layer: (tensors[f"ramp{layer}.weight"], tensors[f"ramp{layer}.bias"])
                 for layer in layers}
        return cls(list(layers), ramps, (tensors["head.weight"], tensors["head.bias"]), threshold)
