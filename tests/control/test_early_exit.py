"""Early exit with off-ramps: regrouped rows give the full path's answer, exits the ramp's."""
import hashlib
import json

import pytest
import torch

import rbcompile
from rbcompile.artifact.offramps import RAMP_FILE, OffRamps, choose_threshold
from rbcompile.artifact.quality import head_logits
from rbcompile.errors import UserError
from rbcompile.runtime.control.early_exit import run_with_exits

from conftest import random_batch


def _full_logits(compiled, ids, mask):
    return head_logits(compiled.offramps.head, compiled(ids, mask)["last_hidden_state"], mask)


def test_calibration_trains_ramps_between_first_and_last_layer(task_bert):
    ramps = task_bert.offramps
    assert ramps.layers == [1, 2]
    assert 0.5 <= ramps.threshold <= 1.0
    assert task_bert.manifest["calibration"]["loss"].startswith("task head")


def test_no_exit_equals_the_full_path_and_all_exit_equals_the_first_ramp(task_bert):
    ids, mask = random_batch(6, 10)
    never = run_with_exits(task_bert, task_bert.offramps, ids, mask, threshold=1.01)
    assert never.exit_layer.tolist() == [-1] * 6
    torch.testing.assert_close(never.logits, _full_logits(task_bert, ids, mask), rtol=0, atol=1e-5)
    always = run_with_exits(task_bert, task_bert.offramps, ids, mask, threshold=0.0)
    assert always.exit_layer.tolist() == [1] * 6 and always.batch_sizes == [0]


def test_unconfident_rows_continue_as_a_smaller_batch(task_bert):
    ids, mask = random_batch(8, 12, seed=3)
    first = run_with_exits(task_bert, task_bert.offramps, ids, mask, threshold=0.0)
    ramp = task_bert.offramps.ramps[1]
    stream_conf = first.logits.softmax(-1).max(-1).values  # ramp-1 confidence of every row
    threshold = stream_conf.median().item()
    result = run_with_exits(task_bert, task_bert.offramps, ids, mask, threshold=threshold)
    exited = result.exit_layer >= 0
    assert 0 < int(exited.sum()) < 8
    assert result.batch_sizes[0] == int((stream_conf < threshold).sum())
    rest = torch.nonzero(result.exit_layer == -1).flatten()
    if len(rest):
        torch.testing.assert_close(result.logits[rest],
                                   _full_logits(task_bert, ids[rest], mask[rest]),
                                   rtol=0, atol=1e-5)
    at_first = torch.nonzero(result.exit_layer == 1).flatten()
    torch.testing.assert_close(result.logits[at_first], first.logits[at_first])
    assert ramp[0].shape == task_bert.offramps.head[0].shape


def test_threshold_keeps_disagreement_within_the_limit():
    torch.manual_seed(0)
    features = {1: torch.randn(200, 4)}
    ramps = OffRamps([1], {1: (torch.eye(2, 4) * 3, torch.zeros(2))}, (torch.eye(2, 4), torch.zeros(2)))
    truth = (features[1] @ torch.eye(2, 4).T).argmax(-1)
    truth[:20] = 1 - truth[:20]  # the full path disagrees with the ramp on 10%
    threshold = choose_threshold(ramps, features, truth, max_disagreement=0.02)
    probs = (features[1] @ ramps.ramps[1][0].T).softmax(-1)
    conf, pred = probs.max(-1)
    exits = conf >= threshold
    assert ((pred != truth) & exits).float().mean() <= 0.02
    assert threshold < 1.0


def test_ramps_survive_save_and_load_and_a_corrupt_file_is_refused(task_bert, tmp_path):
    art = task_bert.save(tmp_path / "task")
    loaded = rbcompile.load(art)
    assert loaded.offramps.layers == task_bert.offramps.layers
    assert loaded.offramps.threshold == pytest.approx(task_bert.offramps.threshold)
    ids, mask = random_batch(4, 9)
    torch.testing.assert_close(run_with_exits(loaded, loaded.offramps, ids, mask).logits,
                               run_with_exits(task_bert, task_bert.offramps, ids, mask).logits)
    (art / RAMP_FILE).write_bytes(b"garbage")
    with pytest.raises(UserError, match="offramps.safetensors: sha256 does not match"):
        rbcompile.load(art)
    manifest = json.loads((art / "manifest.json").read_text())  # re-signed: parsed, refused
    manifest["files"]["sha256"][RAMP_FILE] = hashlib.sha256(b"garbage").hexdigest()
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="cannot load off-ramps"):
        rbcompile.load(art)
