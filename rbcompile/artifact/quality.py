"""Quality of a (possibly light) forward against the full path, one definition for every tool.

Decoders: next-token cross-entropy on the real tokens (lower is better; perplexity = exp) and
top-1 agreement with the full path. Encoders: cosine of mean-pooled embeddings to the full path;
the calibration loss is 1 - cosine. Encoders with a task head (a linear classifier over the
pooled embedding) and labels: cross-entropy of the head, and accuracy. Classifier artifacts
(their own head, `logits` among the outputs): with sequence labels, cross-entropy and accuracy;
otherwise the KL divergence of the class distribution from the full path's (per real token for
token classification) and top-1 agreement with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rbcompile.errors import UserError


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The L2-normalised mean of `hidden` [B, T, H] over the unmasked positions, in fp32
    whatever the model's dtype."""
    hidden = hidden.float()
    weights = mask.unsqueeze(-1).to(hidden)
    return F.normalize((hidden * weights).sum(1) / weights.sum(1).clamp(min=1), dim=-1)


def reference(family: str, outputs: dict, mask: torch.Tensor) -> torch.Tensor:
    """What later calls compare against: full-path top-1 tokens or pooled embeddings."""
    if family == "decoder":
        return outputs["logits"].argmax(-1)
    if "logits" in outputs:  # a classifier artifact: the full path's class log-probabilities
        return outputs["logits"].float().log_softmax(-1)
    return mean_pool(outputs["last_hidden_state"], mask)


def load_head(path) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear head over mean-pooled embeddings: safetensors with `weight` and `bias`."""

    try:
        tensors = load_file(str(path))
        return tensors["weight"], tensors["bias"]
    except Exception as exc:
        raise UserError(f"cannot read classifier head {path}: {exc}") from None


def head_logits(head, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A linear head (weight, bias) over the mean-pooled stream, in fp32 (a head read in fp32
    serves a bf16 / fp16 model)."""
    pooled = mean_pool(hidden, mask)
    weight, bias = (tensor.to(pooled) for tensor in head)
    return pooled @ weight.T + bias


def measure(family: str, outputs: dict, input_ids: torch.Tensor, mask: torch.Tensor,
            full_reference: torch.Tensor, labels=None, head=None) -> dict:
    """Sums (not means) so batches can be added up: see `summarise`."""
    if family == "encoder" and head is not None and labels is not None:
        logits = head_logits(head, outputs["last_hidden_state"], mask)
        return {"loss_sum": F.cross_entropy(logits, labels, reduction="sum").item(),
                "count": len(labels), "agree_sum": int((logits.argmax(-1) == labels).sum()),
                "agree_count": len(labels)}
    if family == "encoder" and "logits" in outputs:
        return _own_head(outputs["logits"], mask, full_reference, labels)
    if family == "decoder":
        logits = outputs["logits"][:, :-1]
        targets = input_ids[:, 1:]
        weight = (mask[:, 1:] * mask[:, :-1]).bool()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="none").view_as(targets)
        agree = outputs["logits"].argmax(-1) == full_reference
        return {"loss_sum": loss[weight].sum().item(), "count": int(weight.sum()),
                "agree_sum": agree[mask.bool()].sum().item(), "agree_count": int(mask.sum())}
    cosine = (mean_pool(outputs["last_hidden_state"], mask) * full_reference).sum(-1)
    return {"loss_sum": (1 - cosine).sum().item(), "count": len(cosine),
            "agree_sum": cosine.sum().item(), "agree_count": len(cosine)}


def _own_head(logits: torch.Tensor, mask: torch.Tensor, full_log_probs: torch.Tensor,
              labels=None) -> dict:
    """A classifier artifact's logits: cross-entropy and accuracy with sequence labels, else KL
    from the full path's distribution and top-1 agreement (real tokens only for per-token
    logits)."""
    log_probs = logits.float().log_softmax(-1)
    if labels is not None and logits.dim() == 2:
        return {"loss_sum": F.nll_loss(log_probs, labels, reduction="sum").item(),
                "count": len(labels), "agree_sum": int((log_probs.argmax(-1) == labels).sum()),
                "agree_count": len(labels)}
    kl = (full_log_probs.exp() * (full_log_probs - log_probs)).sum(-1)
    agree = log_probs.argmax(-1) == full_log_probs.argmax(-1)
    if logits.dim() == 3:
        real = mask.bool()
        kl, agree = kl[real], agree[real]
    return {"loss_sum": kl.sum().item(), "count": kl.numel(), "top1_sum": int(agree.sum()),
            "top1_count": agree.numel()}


def summarise(family: str, parts: list[dict], task: bool = False) -> dict:
    total = {k: sum(p[k] for p in parts) for k in parts[0]}
    loss = total["loss_sum"] / total["count"]
    if "top1_sum" in total:  # a classifier artifact without labels
        return {"loss": loss, "top1_agreement": total["top1_sum"] / total["top1_count"]}
    agreement = total["agree_sum"] / total["agree_count"]
    if family == "decoder":
        return {"loss": loss, "perplexity": float(torch.tensor(loss).exp()),
                "top1_agreement": agreement}
    return {"loss": loss, "accuracy" if task else "cosine": agreement}


def quality_loss(measured: dict, full: dict) -> float:
    """One number for what a plan costs against the full path (>= 0; the guard's unit, see
    rbcompile/artifact/guard.py), from two `summarise` results on the same data. Decoders: the larger of
    the share of next tokens that change (1 - top-1 agreement) and the relative rise in
    perplexity. Classifiers without labels: 1 - top-1 agreement. With labels: the accuracy
    lost. Headless encoders: 1 - cosine to the full path's embeddings."""
    if "top1_agreement" in measured:
        loss = 1.0 - measured["top1_agreement"]
        if "perplexity" in measured:
            loss = max(loss, measured["perplexity"] / full["perplexity"] - 1.0)
    elif "accuracy" in measured:
        loss = full["accuracy"] - measured["accuracy"]
    else:
        loss = full["cosine"] - measured["cosine"]
    return max(0.0, float(loss))
