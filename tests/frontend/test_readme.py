"""The README's and docs/' commands run as written: every `rbcompile ...` line of their shell
blocks parses (commands and flags exist), and the cheap ones run on tiny artifacts in place of
the real ones."""
import re
import shlex
from pathlib import Path

import pytest
import torch

from rbcompile.frontend.cli import _build_parser, main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_ON_TINY = ("models", "inspect", "run", "verify")  # fast on a tiny artifact, no GPU, no server


def readme_commands(pages: list[Path] = PAGES) -> list[list[str]]:
    """argv of each `rbcompile` line in the pages' sh blocks (continuations joined, comments
    and `[optional]` notation removed)."""
    commands = []
    for page in pages:
        for block in re.findall(r"```sh\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if not line.startswith("rbcompile "):
                    continue
                line = re.sub(r"\[[^\]]*\]", "", line)  # [--budget 0.25]: optional, not typed
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def test_readme_is_short_and_shows_every_command():
    assert len(PAGES[0].read_text().splitlines()) <= 300
    commands = readme_commands(PAGES[:1])
    assert {argv[0] for argv in commands} >= {"models", "compile", "inspect", "run", "verify",
                                              "curve", "export-onnx", "serve", "train-policy"}


@pytest.mark.parametrize("argv", readme_commands(), ids=" ".join)
def test_readme_command_parses(argv):
    _build_parser().parse_args(argv)  # an unknown command or flag exits 2 here


@pytest.fixture(scope="module")
def artifacts(compiled_tiny, tmp_path_factory):
    """The README's artifact folders, as tiny artifacts of the same family (the decoder's
    weight precisions measured, as `rbcompile compile` does). Like the bundled SmolLM2 (a GGUF
    of int4 blocks), the tiny llama's block linears are int4 blocks."""
    import rbcompile
    from rbcompile.kernels.int_weights import dequantize, quantize

    from conftest import make_tiny_model, save_tiny_tokenizer

    root = tmp_path_factory.mktemp("readme")
    eager = make_tiny_model("llama")
    with torch.no_grad():
        for name, module in eager.model.layers.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize(quantize(module.weight, 4)))
    eager.save_pretrained(root / "int4-llama")
    save_tiny_tokenizer(root / "int4-llama")
    smol = rbcompile.compile(root / "int4-llama", precisions="auto")
    return {"build/smol": smol.save(root / "smol"),
            "build/minilm": compiled_tiny["bert"][0].save(root / "minilm")}


def test_cheap_readme_commands_run_on_tiny_artifacts(artifacts, capsys):
    ran = 0
    for argv in readme_commands():
        if argv[0] not in RUN_ON_TINY or "cuda" in argv:
            continue
        if argv[0] != "models" and argv[1] not in artifacts:
            continue
        argv = [str(artifacts.get(arg, arg)) for arg in argv]
        assert main(argv) == 0, (argv, capsys.readouterr().err)
        ran += 1
    assert ran >= 6
