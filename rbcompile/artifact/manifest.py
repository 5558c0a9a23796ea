"""The artifact's manifest: file names, schema checks, and the sha256 of every file it lists.

Schema 2 (this version) lists every file of the artifact with its sha256 under
`files.sha256`; `load` verifies them all (streamed) before it uses any, so a flipped byte in the
weights is refused. `validate` checks the parts rbcompile reads (architecture, regions, gates,
plans), so an edited manifest is a one-line error, never an IndexError later. Schema 1 artifacts
(no digests) are still recognised as artifacts, so compiling over one replaces it, but `load`
asks for a recompile.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from rbcompile.errors import UserError

# The lower weight precisions a decoder's steps run at (artifact/executors.py): int8 / int4
# blocks with int8 activations, and int4 blocks with fp32 activations.
PRECISION_LEVELS = ("int8", "int4", "int4-fp32")
PREFILL_LEVELS = ("fp32", "int8")   # prompts' prefills (int8: activations per token)
ACTIVATION_FILE = "activation-max.safetensors"   # Decoder.activation_max

SCHEMA_VERSION = 2
PACKED_SCHEMA_VERSION = 3   # with packed_weights: a reader that cannot unpack refuses it by version
READABLE = (SCHEMA_VERSION, PACKED_SCHEMA_VERSION)
MANIFEST, GRAPH, SOURCE, WEIGHTS, CONFIG = ("manifest.json", "graph.json", "model.py",
                                            "weights.safetensors", "config.json")
KIND = "an rbcompile artifact"
_REGION_KINDS = ("skeleton", "prunable", "cache")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file in `folder` except the manifest, by name."""
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name != MANIFEST}


def _parse(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: missing {MANIFEST} (not an rbcompile artifact)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path / MANIFEST}: corrupt JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path / MANIFEST}: expected a JSON object")
    return manifest


def owned_files(path: Path) -> set[str] | None:
    """The files an artifact folder's manifest lists (itself included), or None when `path`
    holds no rbcompile manifest of a known schema: then it is not ours to replace."""
    try:
        manifest = _parse(path)
    except UserError:
        return None
    files = manifest.get("files")
    if manifest.get("schema_version") not in (1, *READABLE) or not isinstance(files, dict):
        return None
    if manifest["schema_version"] in READABLE:
        listed = files.get("sha256")
        return {MANIFEST, *listed} if isinstance(listed, dict) else None
    names = [files.get(k) for k in ("graph", "source", "weights", "config")]
    names += list(files.get("tokenizer") or [])
    ramps = manifest.get("offramps")
    names += [ramps.get("file")] if isinstance(ramps, dict) else []
    return {MANIFEST, *(n for n in names if isinstance(n, str))}


def read(path: Path) -> dict:
    """The manifest of the artifact at `path`, checked against the schema (see `validate`)."""
    if not path.is_dir():
        raise UserError(f"no such artifact folder: {path}")
    manifest = _parse(path)
    version = manifest.get("schema_version")
    if version not in READABLE:
        hint = "; recompile it with this rbcompile" if version == 1 else ""
        raise UserError(f"{path / MANIFEST}: unsupported schema version {version!r} (this "
                        f"rbcompile reads {' and '.join(map(str, READABLE))}){hint}")
    validate(manifest, path / MANIFEST)
    return manifest


def _fail(where, message: str):
    raise UserError(f"{where}: invalid manifest: {message}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate(manifest: dict, where) -> None:
    """Check what rbcompile reads from a manifest; UserError naming the first problem."""
    arch = manifest.get("architecture")
    if not isinstance(arch, dict) or arch.get("family") not in ("decoder", "encoder"):
        _fail(where, "architecture.family must be 'decoder' or 'encoder'")
    for key in ("vocab_size", "max_positions"):
        if not isinstance(arch.get(key), int) or arch[key] < 1:
            _fail(where, f"architecture.{key} must be a positive integer")
    if arch.get("head") not in (None, "sequence-classification", "token-classification",
                                "causal-lm"):
        _fail(where, f"architecture.head {arch.get('head')!r} is not a known task head")
    names = arch.get("labels")
    if names is not None and not (isinstance(names, list) and names
                                  and all(isinstance(n, str) for n in names)):
        _fail(where, "architecture.labels must be a non-empty list of label names")
    source = manifest.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("name"), str):
        _fail(where, "source.name missing")
    files = manifest.get("files")
    if not isinstance(files, dict) or not isinstance(files.get("sha256"), dict):
        _fail(where, "files.sha256 missing")
    regions = manifest.get("regions")
    if not isinstance(regions, list) or not regions:
        _fail(where, "regions must be a non-empty list")
    gates = []
    for index, region in enumerate(regions):
        if not isinstance(region, dict) or region.get("id") != index:
            _fail(where, f"region {index} must be an object with id {index}")
        if region.get("kind") not in _REGION_KINDS:
            _fail(where, f"region {index} has kind {region.get('kind')!r}")
        if not _number(region.get("flops_share")) or not isinstance(region.get("module_path"), str):
            _fail(where, f"region {index} needs flops_share and module_path")
        if region["kind"] == "prunable":
            if not _number(region.get("prunable_share")) or not isinstance(region.get("gate"), int):
                _fail(where, f"prunable region {index} needs an integer gate and prunable_share")
            gates.append(region["gate"])
    if sorted(gates) != list(range(len(gates))):
        _fail(where, f"gates must be 0..{len(gates) - 1}, one per prunable region")
    decoder = manifest.get("decoder")
    if decoder is not None and not (
            isinstance(decoder, dict) and isinstance(decoder.get("gates"), int)
            and isinstance(decoder.get("shape"), dict)
            and all(isinstance(decoder["shape"].get(k), int) and decoder["shape"][k] > 0
                    for k in ("layers", "kv_heads", "head_dim", "max_positions"))
            and len(decoder["shape"]) == 4
            and decoder.get("activation_max") in (None, ACTIVATION_FILE)):
        _fail(where, "decoder needs integer gates and a shape (layers, kv_heads, head_dim, "
                     f"max_positions), and activation_max is {ACTIVATION_FILE} or absent")
    if (decoder or {}).get("activation_max") and ACTIVATION_FILE not in manifest["files"].get(
            "sha256", {}):
        _fail(where, f"{ACTIVATION_FILE} must be listed with its sha256")
    draft = (decoder or {}).get("draft")
    if draft is not None and not (isinstance(draft, dict) and (
            draft.get("budget") is None or (_number(draft["budget"]) and 0 < draft["budget"] <= 1))):
        _fail(where, "decoder.draft.budget must be null or in (0, 1]")
    _check_precisions(where, manifest.get("precisions"))
    _check_prefills(where, manifest.get("prefill_precisions"))
    if (manifest.get("schema_version") == PACKED_SCHEMA_VERSION) != ("packed_weights" in manifest):
        _fail(where, f"packed_weights come with schema version {PACKED_SCHEMA_VERSION}, and only")
    _check_packed(where, manifest.get("packed_weights"), manifest["files"].get("sha256", {}))
    _check_plans(where, manifest.get("plans"), gates)


def _check_plans(where, plans, gates: list) -> None:
    """The calibrated plans (artifact/plans.py StoredPlan), each gate one of `gates`."""
    if plans is None:
        return
    if not isinstance(plans, list) or not plans:
        _fail(where, "plans must be a non-empty list")
    for plan in plans:
        if not isinstance(plan, dict) or not _number(plan.get("budget")) or not 0 <= plan["budget"] <= 1:
            _fail(where, "each plan needs a budget in [0, 1]")
        skips = plan.get("skip_gates")
        if not isinstance(skips, list) or not all(isinstance(g, int) and 0 <= g < len(gates)
                                                  for g in skips):
            _fail(where, f"plan {plan['budget']}: skip_gates must be gates in 0..{len(gates) - 1}")
        widths = plan.get("widths") or {}
        if not isinstance(widths, dict) or not all(
                str(g).isdigit() and int(g) < len(gates) and _number(w) and 0 < w <= 1
                for g, w in widths.items()):
            _fail(where, f"plan {plan['budget']}: widths must map gates to values in (0, 1]")
        for key in ("quality_loss", "decoder_quality_loss"):  # absent or null: unmeasured
            if plan.get(key) is not None and not (_number(plan[key]) and plan[key] >= 0):
                _fail(where, f"plan {plan['budget']}: {key} must be null or a number >= 0")
        losses = plan.get("precision_losses", {})
        if not isinstance(losses, dict) or not all(
                level in PRECISION_LEVELS and _number(loss) and loss >= 0
                for level, loss in losses.items()):
            _fail(where, f"plan {plan['budget']}: precision_losses must map "
                         f"{' / '.join(PRECISION_LEVELS)} to numbers >= 0")
    if not any(plan["budget"] == 0 for plan in plans):
        _fail(where, "plans must include budget 0 (the full path)")


def _check_precisions(where, precisions) -> None:
    """The weight levels calibration measured (artifact/executors.py StoredPrecision)."""
    if precisions is None:
        return
    if not isinstance(precisions, list) or not all(
            isinstance(entry, dict) and entry.get("level") in PRECISION_LEVELS
            and _number(entry.get("decoder_quality_loss")) and entry["decoder_quality_loss"] >= 0
            and isinstance(entry.get("heldout"), dict)
            and _speedups(entry.get("speedups", {})) for entry in precisions):
        _fail(where, f"precisions must be a list of {{level: {' | '.join(PRECISION_LEVELS)}, "
                     "decoder_quality_loss >= 0, heldout, speedups {rows: > 0} or absent}")


def _check_prefills(where, prefills) -> None:
    """The prefill levels calibration measured (artifact/executors.py StoredPrefill)."""
    if prefills is None:
        return
    levels = ("fp32", *PRECISION_LEVELS)
    if not isinstance(prefills, list) or not all(
            isinstance(entry, dict) and entry.get("level") in PREFILL_LEVELS[1:]
            and isinstance(entry.get("losses"), dict) and entry["losses"] and all(
                level in levels and _number(loss) and loss >= 0
                for level, loss in entry["losses"].items())
            and isinstance(entry.get("heldout"), dict)
            and (entry.get("speedup") is None or (_number(entry["speedup"])
                                                  and entry["speedup"] > 0))
            and isinstance(entry.get("tokens", 0), int) for entry in prefills):
        _fail(where, "prefill_precisions must be a list of {level: "
                     f"{' | '.join(PREFILL_LEVELS[1:])}, losses {{decode level: >= 0}}, heldout, "
                     "speedup > 0 or null, tokens}")


def _speedups(speedups) -> bool:
    return isinstance(speedups, dict) and all(
        str(rows).isdigit() and int(rows) > 0 and _number(speedup) and speedup > 0
        for rows, speedup in speedups.items())


def _check_packed(where, packed, digests: dict) -> None:
    """Linears stored packed (artifact/packed_weights.py): a level, its file (listed with a
    sha256, so it is verified) and the largest weight change."""
    if packed is None:
        return
    from rbcompile.artifact.packed_weights import packed_file

    if not (isinstance(packed, dict) and packed.get("level") in ("int8", "int4")
            and packed.get("file") == packed_file(packed["level"])
            and packed["file"] in digests and _number(packed.get("max_abs_error"))
            and packed["max_abs_error"] >= 0):
        _fail(where, "packed_weights must be {level: int8 | int4, file: weights-LEVEL."
                     "safetensors (listed with its sha256), max_abs_error >= 0}")


def verify_files(path: Path, manifest: dict) -> int:
    """Check every listed file against its sha256 (streamed); returns the bytes read."""
    total = 0
    for name, expected in manifest["files"]["sha256"].items():
        file = path / name
        if Path(name).name != name or not file.is_file():
            raise UserError(f"{path}: missing {name} (listed in the manifest)")
        if sha256_file(file) != expected:
            raise UserError(f"{file}: sha256 does not match the manifest (corrupt or edited)")
        total += file.stat().st_size
    return total
