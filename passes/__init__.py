"""Graph passes. `PIPELINE` is the one ordered list every compilation runs; a calibrated
compilation then runs `CALIBRATED_PIPELINE`, and an artifact's graphs end with
`LAYOUT_PIPELINE`.

Debug: set `RBCOMPILE_DUMP_PASS=<pass name>` (or `PassContext.dump_pass`) to write the graph
before and after that pass to `RBCOMPILE_DUMP_DIR` (default: ./rbcompile-dump).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from torch.fx import GraphModule

from rbcompile.passes.annotate_dependencies import annotate_dependencies
from rbcompile.passes.annotate_flops import annotate_flops
from rbcompile.passes.base import PassContext, PassReport, check_facts
from rbcompile.passes.canonicalize import canonicalize
from rbcompile.passes.discover_blocks import discover_blocks
from rbcompile.passes.form_regions import form_regions
from rbcompile.passes.fuse_kernels import fuse_kernels
from rbcompile.passes.fuse_projections import fuse_projections
from rbcompile.passes.gqa_attention import gqa_attention
from rbcompile.passes.mark_cache_reuse import mark_cache_reuse
from rbcompile.passes.mark_prunable import mark_prunable
from rbcompile.passes.mark_seams import mark_seams
from rbcompile.passes.mark_skeleton import mark_skeleton
from rbcompile.passes.permute_width import permute_width
from rbcompile.passes.share_attention_masks import share_attention_masks
from rbcompile.passes.unpadded_attention import unpadded_attention

logger = logging.getLogger("rbcompile.passes")

PIPELINE = [
    canonicalize,
    gqa_attention,
    share_attention_masks,
    annotate_dependencies,
    annotate_flops,
    discover_blocks,
    mark_skeleton,
    mark_prunable,
    mark_cache_reuse,
    form_regions,
    unpadded_attention,
    fuse_kernels,
    mark_seams,
]

# Passes that need calibration (ctx.width_importance); they change weights, not the graph.
CALIBRATED_PIPELINE = [
    permute_width,
]

# Passes over the weights as the artifact keeps them (permuted, when calibrated): last.
LAYOUT_PIPELINE = [
    fuse_projections,
]

__all__ = ["CALIBRATED_PIPELINE", "LAYOUT_PIPELINE", "PIPELINE", "PassContext", "PassReport",
           "run_pipeline"]


def _dump(gm: GraphModule, ctx: PassContext, name: str, when: str) -> None:
    folder = Path(ctx.dump_dir or os.environ.get("RBCOMPILE_DUMP_DIR", "rbcompile-dump"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.{when}.txt"
    path.write_text(str(gm.graph))
    logger.warning("dumped graph %s %s to %s", when, name, path)


def run_pipeline(gm: GraphModule, ctx: PassContext, passes=PIPELINE) -> list[dict]:
    """Run `passes` in order, checking each contract; returns (and records) the history."""
    established = {f"ctx:{key}" for key in ("blocks", "units", "cache_candidates", "regions",
                                            "width_importance", "permutations")
                   if getattr(ctx, key) is not None}
    dump = ctx.dump_pass or os.environ.get("RBCOMPILE_DUMP_PASS")
    known = {p.pass_name for p in PIPELINE + CALIBRATED_PIPELINE + LAYOUT_PIPELINE}
    if dump and dump not in known:
        raise ValueError(f"unknown pass {dump!r} to dump; passes: {', '.join(sorted(known))}")
    for graph_pass in passes:
        name = graph_pass.pass_name
        missing = [f for f in graph_pass.requires if f not in established]
        if missing:
            raise AssertionError(f"pass {name} requires {missing}, not established before it")
        if dump == name:
            _dump(gm, ctx, name, "before")
        nodes_before = len(gm.graph.nodes)
        start = time.perf_counter()
        result = graph_pass(gm, ctx)
        seconds = time.perf_counter() - start
        check_facts(gm, ctx, graph_pass.ensures, f"pass {name}")
        established.update(graph_pass.ensures)
        if dump == name:
            _dump(gm, ctx, name, "after")
        logger.info("%s: %s (%.2fs)", name, result.summary, seconds)
        ctx.history.append({"pass": name, "changed": result.changed, "summary": result.summary,
                            "nodes_before": nodes_before, "nodes_after": len(gm.graph.nodes),
                            "seconds": round(seconds, 3), "stats": result.stats})
    return ctx.history
