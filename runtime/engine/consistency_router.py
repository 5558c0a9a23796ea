"""The complexity router of self-consistency (`consistency="auto"`): from cheap features of a
prompt and the model's own first-token distribution (the prefill's logits), a small classifier
picks how many answers to vote over: 1 (the greedy answer), 3 or 7 (the greedy answer and 2 or
6 samples).

It is multinomial logistic regression over standardised features, trained (`train_router`) on
questions labelled by running the model (`label_tier`: the fewest votes whose answer is right;
1 when the greedy answer is right or no vote is), with a decision threshold on the probability
of tier 1 (chosen by cross-validation when training). It is stored as JSON (no pickle) with the
sha256 of the checkpoint it was trained for; `find_router` picks the shipped one whose checksum
matches an artifact's.
benchmarks/train_consistency_router.py labels questions and trains one for any decoder
artifact.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rbcompile.calibration_data import DATA
from rbcompile.errors import UserError
from rbcompile.runtime.engine.consistency import tally

TIERS = (1, 3, 7)
SHIPPED = DATA
ROUTER_GLOB = "consistency-router-*.json"
WORD = re.compile(r"[A-Za-z']+|\d+(?:\.\d+)?|[^\sA-Za-z\d]")
REASONING = {"how", "many", "more", "less", "after", "before", "larger", "smaller", "times",
             "equals", "sum", "total", "count", "number", "if", "then", "why", "+", "-", "*",
             "/", "=", "%"}
CREATIVE = {"write", "story", "poem", "imagine", "describe", "invent", "compose", "create",
            "song", "essay"}
FEATURES = ("log_words", "number_share", "long_word_share", "distinct_share", "log_digits",
            "type_fact", "type_reasoning", "type_creative", "entropy", "top_probability",
            "top_margin")


def question_type(words: list[str]) -> str:
    """'creative', 'reasoning' or 'fact', by the words it uses (numbers count as reasoning)."""
    lowered = {word.lower() for word in words}
    if lowered & CREATIVE:
        return "creative"
    if lowered & REASONING or any(word[0].isdigit() for word in words):
        return "reasoning"
    return "fact"


def prompt_features(prompt: str, last_logits: torch.Tensor) -> list[float]:
    """The router's features (`FEATURES`, in order) of a prompt and the logits of its first new
    token. Text features describe the prompt's last non-empty line, the request itself (a
    few-shot prefix is the same for every request): its length, term density (numbers, long
    words, distinct words), digits and question type; then the first token's entropy (nats),
    top probability and the margin between the top two."""
    lines = [line for line in prompt.splitlines() if line.strip()]
    words = WORD.findall(lines[-1] if lines else "")
    count = max(len(words), 1)
    kind = question_type(words)
    probabilities = torch.softmax(last_logits.detach().double().flatten(), -1)
    top = probabilities.topk(2).values.tolist()
    entropy = float(-(probabilities * probabilities.clamp_min(1e-30).log()).sum())
    return [math.log1p(len(words)),
            sum(word[0].isdigit() for word in words) / count,
            sum(len(word) >= 7 for word in words) / count,
            len({word.lower() for word in words}) / count,
            math.log1p(sum(char.isdigit() for char in "".join(words))),
            float(kind == "fact"), float(kind == "reasoning"), float(kind == "creative"),
            entropy, top[0], top[0] - top[1]]


@dataclass
class ComplexityRouter:
    """A trained router: standardisation, then logits = features @ weights.T + bias over
    `TIERS`. It picks tier 1 unless that tier's probability is below `threshold`, then the
    likelier of the others (None: the likeliest tier). `info`: what it was trained for and how
    well it did (checkpoint sha256 and name, seed, accuracies)."""
    mean: list[float]
    std: list[float]
    weights: list[list[float]]          # [tiers, features]
    bias: list[float]
    features: tuple[str, ...] = FEATURES
    tiers: tuple[int, ...] = TIERS
    threshold: float | None = None
    info: dict = field(default_factory=dict)

    def probabilities(self, features) -> torch.Tensor:
        """[n, tiers] tier probabilities of feature rows ([n, features] or one row)."""
        x = torch.as_tensor(features, dtype=torch.float64).reshape(-1, len(self.features))
        x = (x - torch.tensor(self.mean, dtype=torch.float64)) / torch.tensor(self.std, dtype=torch.float64)
        logits = x @ torch.tensor(self.weights, dtype=torch.float64).T + torch.tensor(self.bias, dtype=torch.float64)
        return logits.softmax(-1)

    def tier(self, features) -> int:
        """The number of votes for one feature row."""
        probabilities = self.probabilities(features)[0]
        if self.threshold is not None and 1 in self.tiers:
            one = self.tiers.index(1)
            if probabilities[one] >= self.threshold:
                return 1
            probabilities[one] = -1.0
        return self.tiers[int(probabilities.argmax())]

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> "ComplexityRouter":
        try:
            data = json.loads(Path(path).read_text())
            router = cls(**{**data, "features": tuple(data["features"]),
                            "tiers": tuple(data["tiers"])})
        except FileNotFoundError:
            raise UserError(f"no complexity router at {path}") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise UserError(f"{path}: not a complexity router ({type(exc).__name__}: {exc})") from None
        if router.features != FEATURES or set(router.tiers) - set(TIERS):
            raise UserError(f"{path}: a router over other features or tiers than this "
                            f"rbcompile's ({', '.join(FEATURES)}; tiers {TIERS})")
        return router


def train_router(features, tiers, *, seed: int = 0, l2: float = 1e-3, steps: int = 200,
                 balanced: bool = False, threshold: float | None = None,
                 info: dict | None = None) -> ComplexityRouter:
    """Fit the router to feature rows and their label tiers (1, 3 or 7): multinomial logistic
    regression with an L2 penalty (classes weighted by inverse frequency when `balanced`: more
    votes on the rare tiers, less accuracy), full-batch L-BFGS in float64 from a seeded random
    start. The same inputs and seed give the same router; `threshold`: see `ComplexityRouter`."""
    x = torch.as_tensor(features, dtype=torch.float64)
    if x.ndim != 2 or x.shape[1] != len(FEATURES) or x.shape[0] != len(tiers) or not len(tiers):
        raise UserError(f"router training needs [n, {len(FEATURES)}] features and n tiers; "
                        f"got {tuple(x.shape)} and {len(tiers)}")
    unknown = set(tiers) - set(TIERS)
    if unknown:
        raise UserError(f"router tiers must be 1, 3 or 7, got {sorted(unknown)}")
    y = torch.tensor([TIERS.index(tier) for tier in tiers])
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)
    z = (x - mean) / std
    counts = torch.bincount(y, minlength=len(TIERS)).double()
    class_weights = (torch.where(counts > 0, len(y) / (len(TIERS) * counts.clamp_min(1)), 0.0)
                     if balanced else torch.ones(len(TIERS), dtype=torch.float64))
    generator = torch.Generator().manual_seed(seed)
    weights = (0.01 * torch.randn(len(TIERS), len(FEATURES), generator=generator,
                                  dtype=torch.float64)).requires_grad_()
    bias = torch.zeros(len(TIERS), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights, bias], max_iter=steps, line_search_fn="strong_wolfe")

    def loss():
        optimizer.zero_grad()
        value = (torch.nn.functional.cross_entropy(z @ weights.T + bias, y, weight=class_weights)
                 + l2 * weights.pow(2).sum())
        value.backward()
        return value
    optimizer.step(loss)
    return ComplexityRouter(mean.tolist(), std.tolist(), weights.detach().tolist(),
                            bias.detach().tolist(), threshold=threshold,
                            info={"seed": seed, "l2": l2, "balanced": balanced, **(info or {})})


def vote_of(greedy: str | None, samples: list[str | None], tier: int) -> str | None:
    """The answer of a `tier`-vote over normalised answers: the greedy answer first (ties go to
    it), then the first `tier - 1` samples, as `consistency="auto"` counts them."""

    clusters = tally([greedy, *samples[:tier - 1]])
    return clusters[0].answer if clusters else None


def label_tier(greedy: str | None, samples: list[str | None], answer: str | None) -> int:
    """A training label: the fewest votes (`vote_of`) whose answer is `answer`; 1 when the
    greedy answer is right or no vote is (voting cannot help)."""
    return next((tier for tier in TIERS if vote_of(greedy, samples, tier) == answer), 1)


def find_router(compiled, path=None) -> ComplexityRouter:
    """`path`'s router, else the shipped one trained for the artifact's checkpoint (same
    sha256), else a one-line UserError."""
    if path is not None:
        return path if isinstance(path, ComplexityRouter) else ComplexityRouter.load(path)
    source = (getattr(compiled, "manifest", None) or {}).get("source") or {}
    for candidate in sorted(SHIPPED.glob(ROUTER_GLOB)):
        router = ComplexityRouter.load(candidate)
        if source.get("sha256") and router.info.get("source_sha256") == source["sha256"]:
            return router
    raise UserError(f"no complexity router for this artifact (checkpoint "
                    f"{source.get('name', 'unknown')}); train one with "
                    f"benchmarks/train_consistency_router.py, or use consistency 1, 3 or 7")
