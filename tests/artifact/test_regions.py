"""The region table and its interpreter (rbcompile/artifact/regions.py): the width-level rule, what one
region runs under each gate and width, and the generated module's table."""
import pytest
import torch

from rbcompile.artifact.plans import skipped_share
from rbcompile.artifact.region_cache import RegionCache
from rbcompile.artifact.regions import Region, run_region, run_regions, width_level, width_method

from conftest import ARCHS, random_batch

LEVELS = (0.75, 0.5)  # widest first, as in the table


@pytest.mark.parametrize("width, level", [
    (None, None),   # no request: full width
    (1.0, None),    # above every level: full width
    (0.8, None),
    (0.75, 0.75),   # exactly at a level: that level
    (0.6, 0.75),    # between levels: the narrowest level that is still >= the request
    (0.5, 0.5),
    (0.3, 0.5),     # below the lowest level: clamped to it (the floor)
])
def test_width_level_at_the_boundaries(width, level):
    assert width_level(LEVELS, width) == level
    assert width_level(LEVELS[::-1], width) == level  # the order of the levels does not matter


def test_width_level_without_levels_is_full_width():
    assert width_level((), 0.3) is None


PRUNABLE = Region(3, "prunable", "full", inputs=("size", "stream"), outputs=("out",), gate=1,
                  skip=("out", "stream"), levels=((0.75, "w75"), (0.5, "w50")), drop=("stream",))


@pytest.mark.parametrize("width, method", [(None, "full"), (0.9, "full"), (0.75, "w75"),
                                           (0.7, "w75"), (0.5, "w50"), (0.1, "w50")])
def test_width_method_reads_the_region_gate(width, method):
    assert width_method(PRUNABLE, None if width is None else [1.0, width]) == method


class FakeModule:
    """Region methods that record their calls and tag their output with their name."""

    def __init__(self, regions=()):
        self.REGIONS = tuple(regions)
        self.UNPADDED = None  # no masks a call without padding drops
        self.region_cache = RegionCache()
        self.calls = []

    def __getattr__(self, name):
        def method(*args):
            self.calls.append(name)
            return (f"{name}:{args[-1]}", "second") if name == "pair" else f"{name}:{args[-1]}"
        return method


@pytest.mark.parametrize("gate, widths, expected", [
    (True, None, "full:x"), (True, [1.0, 0.6], "w75:x"), (True, [1.0, 0.2], "w50:x"),
    (False, [1.0, 0.6], "x"),  # off: the stream it reads, nothing runs
])
def test_prunable_region_runs_the_chosen_method_or_passes_the_stream_on(gate, widths, expected):
    module = FakeModule()
    env = {"size": 4, "stream": "x"}
    run_region(module, PRUNABLE, env, [True, gate], widths)
    assert env == {"size": 4, "out": expected}  # the stream's last reader dropped it
    assert module.calls == ([] if not gate else [expected.split(":")[0]])


def test_cache_region_is_looked_up_and_skeleton_outputs_unpacked():
    cache = Region(0, "cache", "pair", inputs=("mask",), outputs=("a", "b"))
    skeleton = Region(1, "skeleton", "single", inputs=("a",), outputs=("c",), drop=("a",))
    module = FakeModule([cache, skeleton])
    for _ in range(2):
        env = run_regions(module, {"mask": torch.ones(2, 3)}, gates=[])
        assert env["b"] == "second" and env["c"].startswith("single:pair:") and "a" not in env
    assert module.calls == ["pair", "single", "single"]  # the second cache region call hits
    assert module.region_cache.hits == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_generated_table_names_the_generated_methods(calibrated_tiny, arch):
    compiled = calibrated_tiny[arch]
    table = compiled.module.REGIONS
    assert [r.id for r in table] == [r["id"] for r in compiled.regions]
    defined = {name for name in type(compiled.module).__dict__ if name.startswith("r")
               and callable(getattr(type(compiled.module), name))}
    assert defined == {name for region in table for name in region.methods}
    prunable = [r for r in table if r.kind == "prunable"]
    assert sorted(r.gate for r in prunable) == list(range(compiled.num_gates))
    assert any(r.levels for r in prunable)  # calibrated with width levels
    for region in prunable:
        ratios = [ratio for ratio, _ in region.levels]
        assert ratios == sorted(ratios, reverse=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_keeps_only_inputs_and_outputs(calibrated_tiny, arch):
    """Each value is dropped after its last reader: nothing else is left at the end."""
    compiled = calibrated_tiny[arch]
    ids, mask = random_batch(2, 7)
    env = run_regions(compiled.module, dict(zip(compiled.ir["inputs"], (ids, mask))),
                      [True] * compiled.num_gates)
    assert set(env) == {*compiled.ir["inputs"], *(var for _, var in compiled.ir["outputs"])}


def test_skipped_share_counts_the_level_that_runs(calibrated_tiny):
    """FLOP accounting uses the same rule: a request between levels costs the wider level."""
    compiled = calibrated_tiny["llama"]
    region = next(r for r in compiled.regions if r["kind"] == "prunable")
    shares = compiled.width_shares[region["id"]]
    widest, lowest = max(shares), min(shares)
    gates = [True] * compiled.num_gates

    def saved(width):
        widths = [1.0] * compiled.num_gates
        widths[region["gate"]] = width
        return skipped_share(compiled.regions, gates, widths, compiled.width_shares)

    assert saved(1.0) == 0.0
    assert saved(widest) == pytest.approx(region["prunable_share"] - shares[widest])
    assert saved(lowest / 2) == pytest.approx(region["prunable_share"] - shares[lowest])
