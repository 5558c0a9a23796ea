"""Task heads: which transformers head classes an artifact keeps, and how they are traced.

The head comes from the model class (`BertForSequenceClassification`: the class a checkpoint's
config.json names under `architectures`, or the class of a loaded module):
- encoders: `*Model` (no head: hidden states), `*ForSequenceClassification` and
  `*ForTokenClassification` (the head stays in the artifact: its `logits`, and the encoder's
  `last_hidden_state` for embeddings); the pre-training heads `*ForMaskedLM` / `*ForPreTraining`
  are left out with a message (the encoder body is compiled, as for `*Model`);
- decoders: `*ForCausalLM` (and `*Model`, loaded with a causal-LM head as before): `logits`.
Any other head (question answering, multiple choice, ...) is refused in one line: never a silent
drop. Label names come from the config's `id2label` (`CompiledModel.labels`).
"""
from __future__ import annotations

import torch

from rbcompile.artifact.architectures import DECODER
from rbcompile.errors import UserError

# Deferred on purpose: transformers loads inside `auto_class`, so loading an artifact loads no
# model class.

SEQUENCE, TOKEN, CAUSAL_LM = "sequence-classification", "token-classification", "causal-lm"
CLASSIFIERS = (SEQUENCE, TOKEN)
_KEPT = {"ForSequenceClassification": SEQUENCE, "ForTokenClassification": TOKEN,
         "ForCausalLM": CAUSAL_LM}
_PRETRAINING = ("ForMaskedLM", "ForPreTraining")
SUPPORTED = ("encoders: *Model (hidden states), *ForSequenceClassification, "
             "*ForTokenClassification; decoders: *ForCausalLM")


def _suffix(class_name: str) -> str:
    index = class_name.find("For")
    return class_name[index:] if index > 0 else ""


def head_of(class_name: str | None, family: str) -> str | None:
    """The head kept for a model class: SEQUENCE, TOKEN, CAUSAL_LM, or None (an encoder's
    hidden states); a one-line UserError for a head the compiler does not know."""
    suffix = _suffix(class_name or "")
    if family == DECODER:
        if not suffix or suffix == "ForCausalLM":
            return CAUSAL_LM
    elif not suffix or suffix in _PRETRAINING:
        return None
    elif _KEPT.get(suffix) in CLASSIFIERS:
        return _KEPT[suffix]
    raise UserError(f"unsupported task head: {class_name} ({family}); supported: {SUPPORTED}")


def checkpoint_class(config: dict) -> str | None:
    """The model class a config.json names (its first `architectures` entry)."""
    classes = config.get("architectures") or []
    return classes[0] if classes and isinstance(classes[0], str) else None


def is_pretraining_head(class_name: str | None) -> bool:
    return _suffix(class_name or "") in _PRETRAINING


def auto_class(head: str | None, family: str):
    """The transformers Auto class that loads a checkpoint with `head`."""
    import transformers

    if family == DECODER:
        return transformers.AutoModelForCausalLM
    return {None: transformers.AutoModel,
            SEQUENCE: transformers.AutoModelForSequenceClassification,
            TOKEN: transformers.AutoModelForTokenClassification}[head]


def module_head(model: torch.nn.Module, family: str) -> str | None:
    """The head of a loaded transformers module (see `head_of`)."""
    return head_of(type(model).__name__, family)


def labels(config, head: str | None) -> list[str] | None:
    """Label names by class index (the config's `id2label`) for a classifier head, else None."""
    if head not in CLASSIFIERS:
        return None
    read = config.get if isinstance(config, dict) else lambda n, d=None: getattr(config, n, d)
    id2label = read("id2label") or {}
    count = read("num_labels") or len(id2label)
    names = {int(k): str(v) for k, v in id2label.items()}
    count = max(count, len(names))
    return [names.get(i, f"LABEL_{i}") for i in range(count)]


class ClassifierOutputs(torch.nn.Module):
    """A classifier traced for its `logits` and the encoder's `last_hidden_state` (embeddings,
    calibration and early exit read it). trace.py strips the `model.` prefix afterwards, so
    parameter and module paths are the classifier's own."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         output_hidden_states=True, return_dict=True)
        return {"logits": out.logits, "last_hidden_state": out.hidden_states[-1]}
