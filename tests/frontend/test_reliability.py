"""The bad-input corpus: every case gives its exit code and a last stderr line without a
traceback, deletes nothing of the user's and leaves no temporary or `.old` folder; artifacts are
verified (a flipped weight byte is refused); signals leave the output as it was."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rbcompile.frontend.cli import main

CLI = [sys.executable, "-m", "rbcompile.frontend.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}


def _last_error(capsys, prefix="rbcompile: error:") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(prefix), err
    return last


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _no_leftovers(parent: Path, name: str) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.fixture(scope="module")
def artifact(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability") / "llama"
    assert main(["compile", str(tiny_checkpoints["llama"]), "-o", str(out)]) == 0
    return out


def _copy(artifact: Path, dest: Path) -> Path:
    import shutil
    shutil.copytree(artifact, dest)
    return dest


# ---- never delete what rbcompile did not write ----------------------------------------------

def test_user_folder_with_a_stray_manifest_survives_byte_for_byte(tiny_checkpoints, tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "manifest.json").write_text('{"my": "own manifest"}')
    (user / "notes.txt").write_text("precious")
    before = _snapshot(user)
    start = time.perf_counter()
    assert main(["compile", str(tiny_checkpoints["llama"]), "-o", str(user)]) == 2
    assert "is not an rbcompile artifact; refusing to replace it" in _last_error(capsys)
    assert time.perf_counter() - start < 2  # refused before loading or tracing anything
    assert _snapshot(user) == before
    _no_leftovers(tmp_path, "mine")


def test_artifact_folder_with_a_user_file_is_not_replaced(artifact, tiny_checkpoints, tmp_path, capsys):
    target = _copy(artifact, tmp_path / "art")
    (target / "results.csv").write_text("mine")
    before = _snapshot(target)
    assert main(["compile", str(tiny_checkpoints["llama"]), "-o", str(target)]) == 2
    assert "holds files that are not part of an rbcompile artifact (results.csv)" in _last_error(capsys)
    assert _snapshot(target) == before


def test_empty_folder_and_earlier_artifact_are_replaced(artifact, tiny_checkpoints, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compile", str(tiny_checkpoints["llama"]), "-o", str(empty)]) == 0
    earlier = _copy(artifact, tmp_path / "earlier")
    assert main(["compile", str(tiny_checkpoints["gpt2"]), "-o", str(earlier)]) == 0
    assert json.loads((earlier / "manifest.json").read_text())["architecture"]["model_type"] == "gpt2"
    _no_leftovers(tmp_path, "earlier")


def test_schema_1_artifact_is_replaced_but_not_loaded(artifact, tiny_checkpoints, tmp_path, capsys):
    old = _copy(artifact, tmp_path / "old")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["schema_version"] = 1
    del manifest["files"]["sha256"]
    for name in ("decoder_graph.json", "decoder.py", "activation-max.safetensors"):
        (old / name).unlink()   # schema 1 had no KV-cached decoder
    del manifest["decoder"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert main(["inspect", str(old)]) == 2
    assert "unsupported schema version 1 (this rbcompile reads 2 and 3); recompile it" in _last_error(capsys)
    assert main(["compile", str(tiny_checkpoints["llama"]), "-o", str(old)]) == 0


def test_output_under_a_file_is_refused_before_work(tiny_checkpoints, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["compile", str(tiny_checkpoints["llama"]), "-o", str(tmp_path / "file" / "out")]) == 2
    assert "is not a folder" in _last_error(capsys)


# ---- signals --------------------------------------------------------------------------------

@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_signals_at_each_stage_leave_the_output_as_it_was(artifact, tiny_checkpoints, tmp_path,
                                                           signum, code):
    """Signals at several moments of a compile over an earlier artifact: either the compile
    finished (exit 0, a complete new artifact) or it was stopped (130 / 143) and the earlier
    artifact is byte for byte as it was; never a temporary folder."""
    target = _copy(artifact, tmp_path / "art")
    before = _snapshot(target)
    outcomes = set()
    for delay in (0.3, 0.6, 1.0, 2.5, 4.0, 6.0):  # imports, load, trace, passes, write
        process = subprocess.Popen([*CLI, "compile", str(tiny_checkpoints["gpt2"]), "-o",
                                    str(target)], env=ENV, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        process.send_signal(signum)
        _, err = process.communicate(timeout=120)
        assert "Traceback" not in err
        assert process.returncode in (0, code), err
        _no_leftovers(tmp_path, "art")
        if process.returncode == 0:
            assert json.loads((target / "manifest.json").read_text())["architecture"]["model_type"] == "gpt2"
            assert main(["verify", str(target)]) == 0
            outcomes.add("finished")
            break
        assert _snapshot(target) == before
        outcomes.add("stopped")
    assert "stopped" in outcomes


def test_signal_during_the_swap_does_not_undo_a_finished_write(tmp_path, monkeypatch):
    """A signal held while the new folder is swapped in is dropped: the write is complete, so
    the command must not end as "stopped" (which promises the old folder)."""
    from rbcompile.artifact import atomic

    def terminated(signum, frame):
        raise RuntimeError("signal delivered after the swap")

    swap = atomic._swap
    done = threading.Event()
    other = threading.Thread(target=done.wait)  # a thread that does not mask the signals
    other.start()

    def swap_then_signalled(new, out_dir):
        swap(new, out_dir)
        os.kill(os.getpid(), signal.SIGTERM)              # to the process (this thread masks it)
        signal.pthread_kill(other.ident, signal.SIGTERM)  # taken by the other thread
        time.sleep(0.05)

    monkeypatch.setattr(atomic, "_swap", swap_then_signalled)
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        atomic.write_folder(tmp_path / "out", lambda tmp: (tmp / "a.txt").write_text("new"),
                            lambda folder: {"a.txt"}, "a test folder")
        time.sleep(0.05)  # a handler still to run would run by now
    finally:
        signal.signal(signal.SIGTERM, previous)
        done.set()
        other.join()
    assert (tmp_path / "out" / "a.txt").read_text() == "new"


def test_a_stopped_command_drops_what_libraries_log_while_it_unwinds(monkeypatch, capsys):
    """A SIGINT inside torch's fake-tensor dispatch once printed torch's "fake tensor raised
    TypeError" and its traceback before rbcompile's one line: a C++ binding made a TypeError of
    the KeyboardInterrupt, and torch logs that error before re-raising it."""
    import logging

    from rbcompile.frontend import cli

    library_log = logging.getLogger("torch._subclasses.fake_tensor")
    records = []
    handler = logging.Handler()
    handler.emit = records.append

    def interrupted_inside_a_library(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here
        except KeyboardInterrupt:
            try:
                raise TypeError("incompatible function arguments") from None
            except TypeError:
                library_log.exception("fake tensor raised TypeError")
                raise

    monkeypatch.setitem(cli.COMMANDS, "models", interrupted_inside_a_library)
    library_log.addHandler(handler)
    try:
        assert main(["models"]) == 130
        assert records == []
        library_log.warning("after the command")  # logging is back as it was
        assert [record.getMessage() for record in records] == ["after the command"]
    finally:
        library_log.removeHandler(handler)
    assert capsys.readouterr().err == "rbcompile: interrupted\n"


def test_signal_after_the_output_is_in_place_does_not_stop_the_command(tiny_checkpoints, tmp_path,
                                                                       monkeypatch):
    """A SIGTERM between the swap and the command's end (its last messages) would report
    "terminated" (143, which promises the old output) with the new artifact in place."""
    from rbcompile.artifact.compiled import CompiledModel

    save = CompiledModel.save

    def save_then_signalled(self, out_dir, weights=None):
        out = save(self, out_dir, weights)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here
        return out

    monkeypatch.setattr(CompiledModel, "save", save_then_signalled)
    assert main(["compile", str(tiny_checkpoints["gpt2"]), "-o", str(tmp_path / "art")]) == 0
    assert main(["verify", str(tmp_path / "art")]) == 0


def test_a_stop_that_code_swallowed_still_keeps_the_earlier_artifact(artifact, tiny_checkpoints,
                                                                    tmp_path, monkeypatch, capsys):
    """A SIGINT whose KeyboardInterrupt a library catches (a C++ binding turns it into a
    TypeError, and the caller goes on) let the compile run on and swap its artifact in, then
    exit 130: "interrupted", with the earlier artifact gone."""
    from rbcompile.artifact.compiled import CompiledModel

    save = CompiledModel.save

    def swallowed_then_save(self, out_dir, weights=None):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here
        except KeyboardInterrupt:
            pass
        return save(self, out_dir, weights)

    target = _copy(artifact, tmp_path / "art")
    before = _snapshot(target)
    monkeypatch.setattr(CompiledModel, "save", swallowed_then_save)
    assert main(["compile", str(tiny_checkpoints["gpt2"]), "-o", str(target)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "rbcompile: interrupted"
    assert _snapshot(target) == before
    _no_leftovers(tmp_path, "art")
    monkeypatch.undo()  # the next command is not stopped by the one before
    assert main(["compile", str(tiny_checkpoints["gpt2"]), "-o", str(target)]) == 0


def test_signal_while_the_process_exits_leaves_its_exit_code():
    """After the command, CPython finalises (torch's teardown takes a while) with the default
    handlers back in place of Python ones: a SIGTERM then killed the process (-15) whose
    artifact was complete. `__main__`'s globals are deleted while Python finalises."""
    script = ("import os, signal, sys, time\n"
              "class SignalledAtExit:\n"
              "    def __del__(self):\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        time.sleep(0.05)\n"
              "at_exit = SignalledAtExit()\n"
              "from rbcompile.frontend import cli\n"
              "sys.argv = ['rbcompile', 'models']\n"
              "cli.entry()\n")
    result = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "smollm2-135m" in result.stdout


def test_signal_in_a_held_block_is_delivered_when_it_ends():
    from rbcompile.artifact import atomic

    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with atomic.signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert received == []
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]


def test_concurrent_compiles_to_one_output(tiny_checkpoints, tmp_path):
    target = tmp_path / "art"
    processes = [subprocess.Popen([*CLI, "compile", str(tiny_checkpoints[arch]), "-o", str(target)],
                                  env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for arch in ("llama", "gpt2")]
    for process in processes:
        _, err = process.communicate(timeout=180)
        assert process.returncode == 0 and "Traceback" not in err, err
    assert main(["verify", str(target)]) == 0
    _no_leftovers(tmp_path, "art")


# ---- validate before work -------------------------------------------------------------------

def test_prompt_past_the_positions_is_refused_with_the_numbers(artifact, capsys):
    assert main(["run", str(artifact), "--text", "the " * 100_000]) == 2
    assert "tokens; the model has 64 positions, so at most 63 prompt tokens" in _last_error(capsys)


def test_max_new_tokens_past_the_positions_is_clipped_with_a_warning(artifact, capsys):
    assert main(["run", str(artifact), "--text", "the a of", "--max-new-tokens", "100000"]) == 0
    err = capsys.readouterr().err
    assert "--max-new-tokens 100000 clipped to" in err and "64 positions" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("text", ["bad \udcff byte", "lone \ud800 surrogate"])
def test_invalid_unicode_text_names_the_position(artifact, capsys, text):
    assert main(["run", str(artifact), "--text", text]) == 2
    assert "--text is not valid Unicode: character" in _last_error(capsys)


def test_invalid_unicode_on_the_command_line(artifact):
    result = subprocess.run([*CLI, "run", str(artifact), "--text", b"caf\xe9".decode(
        "utf-8", "surrogateescape")], env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        "rbcompile: error: --text is not valid Unicode: character 3")


def test_jsonl_calibration_with_a_lone_surrogate(tiny_checkpoints, tmp_path, capsys):
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": "fine"}\n{"text": "bad \\ud800 text"}\n')
    assert main(["compile", str(tiny_checkpoints["llama"]), "--calib", str(data), "-o",
                 str(tmp_path / "out")]) == 2
    assert "calib.jsonl:2: the text is not valid Unicode: character 4" in _last_error(capsys)
    _no_leftovers(tmp_path, "out")


def test_calibration_without_a_tokenizer_is_refused_before_work(tiny_checkpoints, tmp_path, capsys):
    import shutil
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_checkpoints["llama"] / name, bare / name)
    assert main(["compile", str(bare), "--calib", "default", "-o", str(tmp_path / "out")]) == 2
    last = _last_error(capsys)
    assert "has no tokenizer files" in last
    assert not (tmp_path / "out").exists()


def test_config_that_does_not_match_the_weights_gives_one_line(tiny_checkpoints, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["llama"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 40
    (broken / "config.json").write_text(json.dumps(config))
    result = subprocess.run([*CLI, "compile", str(broken), "-o", str(tmp_path / "out")], env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if not line.startswith("loading ")]
    assert lines == [f"rbcompile: error: cannot load {broken}: the weights' shapes do not match "
                     "config.json (RBCOMPILE_DEBUG=1 shows transformers' load report)"]


@pytest.mark.parametrize("content,message", [
    (b"", "has no text"), (bytes(range(256)) * 4, "is not UTF-8 text")], ids=["empty", "binary"])
def test_bad_calibration_files(tiny_checkpoints, tmp_path, capsys, content, message):
    data = tmp_path / "calib.txt"
    data.write_bytes(content)
    assert main(["compile", str(tiny_checkpoints["llama"]), "--calib", str(data), "-o",
                 str(tmp_path / "out")]) == 2
    assert message in _last_error(capsys)
    _no_leftovers(tmp_path, "out")


@pytest.mark.parametrize("budget", ["nan", "-0.1", "1.01", "inf"])
def test_bad_budgets(artifact, capsys, budget):
    assert main(["run", str(artifact), "--text", "the", "--budget", budget]) == 2
    assert "budget must be" in _last_error(capsys)


@pytest.mark.parametrize("how,message", [
    ("zero-byte", "corrupt safetensors file"),
    ("pickle-only", "no *.safetensors weights (pickle .bin weights are not loaded)"),
    ("empty-folder", "missing config.json"),
])
def test_bad_checkpoints(tiny_checkpoints, tmp_path, capsys, how, message):
    import shutil
    folder = tmp_path / "ckpt"
    folder.mkdir()
    if how != "empty-folder":
        shutil.copy(tiny_checkpoints["llama"] / "config.json", folder)
    if how == "zero-byte":
        (folder / "model.safetensors").write_bytes(b"")
    if how == "pickle-only":
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    assert main(["compile", str(folder), "-o", str(tmp_path / "out")]) == 2
    assert message in _last_error(capsys)
    _no_leftovers(tmp_path, "out")


# ---- integrity ------------------------------------------------------------------------------

def test_verify_a_good_artifact(artifact, capsys):
    assert main(["verify", str(artifact)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{artifact}: ok (") and "sha256 verified; schema 2" in out


@pytest.mark.parametrize("command", ["verify", "run"])
def test_one_flipped_weight_byte_is_refused(artifact, tmp_path, capsys, command):
    target = _copy(artifact, tmp_path / "art")
    weights = target / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's values: the file still parses
    weights.write_bytes(bytes(data))
    argv = [command, str(target)] + (["--text", "the"] if command == "run" else [])
    assert main(argv) == 2
    assert "weights.safetensors: sha256 does not match the manifest" in _last_error(capsys)


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["regions"][0].update(kind="bogus"), "region 0 has kind 'bogus'"),
    (lambda m: m["regions"].pop(), "do not match graph.json"),
    (lambda m: m.update(plans=[{"budget": 0.0, "skip_gates": []},
                               {"budget": 0.2, "skip_gates": [99]}]),
     "plan 0.2: skip_gates must be gates in 0.."),
    (lambda m: m.update(plans=[{"budget": 0.3, "skip_gates": []}]), "must include budget 0"),
    (lambda m: m["architecture"].update(vocab_size="many"), "vocab_size must be a positive integer"),
    (lambda m: m["files"]["sha256"].update({"../etc/passwd": "0"}), "missing ../etc/passwd"),
])
@pytest.mark.parametrize("command", ["inspect", "run", "verify"])
def test_edited_manifest_is_a_one_line_error(artifact, tmp_path, capsys, edit, message, command):
    target = _copy(artifact, tmp_path / "art")
    manifest = json.loads((target / "manifest.json").read_text())
    edit(manifest)
    (target / "manifest.json").write_text(json.dumps(manifest))
    argv = [command, str(target)] + (["--text", "the"] if command == "run" else [])
    if command == "inspect" and message in ("do not match graph.json", "missing ../etc/passwd"):
        return  # inspect reads the manifest only, which is self-consistent here
    assert main(argv) == 2
    last = _last_error(capsys)
    assert message in last
