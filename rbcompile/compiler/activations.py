"""The channel maxima of every linear's input on calibration text: what the int8 prefill's
smoothing reads (kernels/token_int8.py `smoothing`), stored in the artifact.

The decoder's torch module runs each calibration batch as one prefill; every `aten.linear` it
calls is seen on its way (a TorchFunctionMode) and its input's |x| maxima per channel kept
under the name of the weight it multiplies.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from rbcompile.artifact.module import weights as module_weights


class _LinearInputs(TorchFunctionMode):
    """Keeps max |x| per input channel of each `aten.linear` whose weight is one of `names`
    (data pointer -> weight name)."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names, self.maxima = names, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.linear.default and args[1].data_ptr() in self.names:
            name = self.names[args[1].data_ptr()]
            seen = args[0].detach().abs().flatten(0, -2).amax(dim=0).float()
            kept = self.maxima.get(name)
            self.maxima[name] = seen if kept is None else torch.maximum(kept, seen)
        return func(*args, **(kwargs or {}))


def activation_maxima(compiled, batches) -> dict[str, torch.Tensor]:
    """weight name -> max |input| per channel [in] over `batches` ([(input_ids, mask)]),
    through the decoder's torch module (the reference path), for its 2-D weights."""
    from rbcompile.artifact.step_executor import sequence_logits

    decoder = compiled.decoder
    names = {tensor.data_ptr(): name for name, tensor in module_weights(decoder.module).items()
             if tensor.dim() == 2}
    executor = decoder.executor
    decoder.executor = None   # the torch module, whatever runs the steps
    shape = decoder.shape
    try:
        with torch.no_grad(), _LinearInputs(names) as recorder:
            for ids, mask in batches:
                sequence_logits(decoder, ids, mask, shape.kv_heads, shape.head_dim,
                                shape.layers)
    finally:
        decoder.executor = executor
    return {name: maxima.contiguous() for name, maxima in sorted(recorder.maxima.items())}
