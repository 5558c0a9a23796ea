"""Loading an artifact: every file checked, the module regenerated from its graph."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rbcompile.artifact import manifest as manifests
from rbcompile.artifact.codegen import generate_source
from rbcompile.artifact.compiled import CompiledModel
from rbcompile.artifact.decoder import (
    DECODER_GRAPH,
    DECODER_SOURCE,
    STEP_INPUTS,
    Decoder,
    DecoderShape,
)
from rbcompile.artifact.ir import check_ir
from rbcompile.artifact.manifest import ACTIVATION_FILE, CONFIG, GRAPH, MANIFEST, SOURCE, WEIGHTS
from rbcompile.artifact.module import attach_weights, instantiate
from rbcompile.artifact.offramps import RAMP_FILE, OffRamps
from rbcompile.artifact.packed_weights import unpack
from rbcompile.artifact.placement import check_same_dtype, parse_device, parse_dtype
from rbcompile.errors import UserError, first_line


def load_artifact(path, device=None, dtype=None, model_class: type = CompiledModel) -> CompiledModel:
    """Load an artifact onto `device` (default cpu), as a `model_class` (a CompiledModel; the
    run side's adds generation, runtime/engine/model.py). Every file is checked against the sha256
    the manifest lists, and the manifest against its schema (rbcompile/artifact/manifest.py); the module
    is regenerated from graph.json (checked against an op allow-list) and must match the stored
    model.py; weights come from safetensors only. `dtype`, if given, must be the dtype the
    artifact was compiled in."""

    path = Path(path)
    device = parse_device(device) or torch.device("cpu")
    requested_dtype = parse_dtype(dtype)
    manifest = manifests.read(path)
    manifests.verify_files(path, manifest)
    stored_dtype = getattr(torch, manifest.get("architecture", {}).get("dtype", "float32"))
    check_same_dtype(stored_dtype, requested_dtype)
    files = manifest["files"]
    ir, source = _read_graph(path, GRAPH, SOURCE)
    try:
        tensors = load_file(str(path / WEIGHTS), device=str(device))
    except FileNotFoundError:
        raise UserError(f"{path}: missing {WEIGHTS}") from None
    except Exception as exc:
        raise UserError(f"corrupt safetensors file {path / WEIGHTS}: "
                        f"{first_line(exc)}") from None
    packed = {}
    if "packed_weights" in manifest:
        from rbcompile.kernels.int_weights import dequantize

        packed = unpack(path / manifest["packed_weights"]["file"])
        tensors.update({key: dequantize(value).to(device, stored_dtype)
                        for key, value in packed.items()})
    module = instantiate(source, str(path))
    attach_weights([module], tensors)
    if (len(manifest["regions"]) != len(ir["regions"])
            or sum(r["kind"] == "prunable" for r in manifest["regions"]) != module.NUM_GATES):
        raise UserError(f"{path / MANIFEST}: invalid manifest: its regions do not match {GRAPH}")
    try:
        hf_config = json.loads((path / CONFIG).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        hf_config = {}
    tokenizer_dir = path if files.get("tokenizer") else None
    decoder = None
    if "decoder" in manifest:
        decoder_ir, decoder_source = _read_graph(path, DECODER_GRAPH, DECODER_SOURCE)
        if tuple(decoder_ir["inputs"][:len(STEP_INPUTS)]) != STEP_INPUTS:
            raise UserError(f"{path}: its decoder was built by an older rbcompile (step inputs "
                            f"{', '.join(decoder_ir['inputs'][:4])}, ...); compile it again")
        decoder_module = instantiate(decoder_source, f"{path} decoder")
        attach_weights([module, decoder_module], tensors)  # (it reads views of its stacks)
        decoder = Decoder(decoder_module, decoder_ir, decoder_source,
                          DecoderShape(**manifest["decoder"]["shape"]),
                          manifest["decoder"].get("draft"))
    compiled = model_class(module, ir, source, manifest, tokenizer_dir=tokenizer_dir,
                           hf_config=hf_config, decoder=decoder)
    compiled.loaded_packing = packed     # save() keeps these blocks where weights are unchanged
    if "offramps" in manifest:
        compiled.offramps = _load_offramps(path, manifest["offramps"]).to(device)
    if decoder is not None and manifest["decoder"].get("activation_max"):
        decoder.activation_max = _activation_maxima(path / ACTIVATION_FILE, tensors)
    return compiled


def _read_graph(path: Path, graph_name: str, source_name: str) -> tuple[dict, str]:
    """(IR, source) of one generated module: the IR checked against the op allow-list, the
    source regenerated from it and compared with the stored file."""
    try:
        graph_bytes = (path / graph_name).read_bytes()
        stored_source = (path / source_name).read_text()
    except (FileNotFoundError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read artifact file ({exc.__class__.__name__}: "
                        f"{getattr(exc, 'filename', None) or exc})") from None
    try:
        ir = json.loads(graph_bytes)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path / graph_name}: corrupt JSON ({exc})") from None
    if not isinstance(ir, dict):
        raise UserError(f"{path / graph_name}: expected a JSON object")
    check_ir(ir)
    source = generate_source(ir)
    if source != stored_source:
        raise UserError(f"{path / source_name}: does not match the code regenerated from "
                        f"{graph_name} (edited, or written by another rbcompile version: compile "
                        "it again)")
    return ir, source


def _activation_maxima(file: Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Decoder.activation_max: per weight, one finite value >= 0 per input channel."""
    try:
        maxima = load_file(str(file))
    except Exception as exc:
        raise UserError(f"{file}: cannot load activation maxima ({first_line(exc)})") from None
    for name, values in maxima.items():
        weight = weights.get(name)
        if (weight is None or weight.dim() != 2 or values.shape != (weight.shape[1],)
                or not values.is_floating_point() or not torch.isfinite(values).all()
                or (values < 0).any()):
            raise UserError(f"{file}: the activation maxima of {name} do not fit its weight "
                            "(one finite value >= 0 per input channel)")
    return maxima


def _load_offramps(path: Path, spec: dict) -> OffRamps:
    try:
        return OffRamps.from_tensors(load_file(str(path / RAMP_FILE)), [int(x) for x in spec["layers"]],
                                     float(spec["threshold"]))
    except Exception as exc:
        raise UserError(f"{path / RAMP_FILE}: cannot load off-ramps "
                        f"({first_line(exc)})") from None
