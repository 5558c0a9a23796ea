"""Shared fixtures: tiny random checkpoints (made with save_pretrained) and compiled models."""
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any `import triton`
# The checkout's root must not be on sys.path: its kernels/ would shadow Hugging Face's
# `kernels` package (see rbcompile/child.py). `python -m pytest` puts it there; the tests'
# `python -m` / `-c` children, started from it, keep it off by SAFE_PATH.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]

from rbcompile.child import SAFE_PATH  # noqa: E402

os.environ.update(SAFE_PATH)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

TINY_VOCAB = 96


def unguarded(compiled):
    """`compiled` with every plan allowed (rbcompile/artifact/guard.py): the tiny random models' plans
    are unmeasured or cost most of their quality, and the tests of skipping need them to run."""
    from rbcompile.artifact.guard import UNGUARDED

    compiled.guard = UNGUARDED
    return compiled


def tiny_config(arch: str):
    from transformers import BertConfig, GPT2Config, LlamaConfig

    if arch == "llama":  # GQA: 4 query heads share 2 KV heads
        return LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
    if arch == "gpt2":
        return GPT2Config(vocab_size=TINY_VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                          bos_token_id=1, eos_token_id=2)
    if arch == "bert":
        return BertConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=4,
                          num_attention_heads=4, intermediate_size=48, max_position_embeddings=64)
    raise ValueError(arch)


def make_tiny_model(arch: str):
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(0)
    auto = AutoModel if arch == "bert" else AutoModelForCausalLM
    return auto.from_config(tiny_config(arch)).eval()


ARCHS = ("llama", "gpt2", "bert")
WORDS = ("the a of and to in is was it that he she for on with as his her at by this had not "
         "but from be they have one all were which an or are there we so when what who no "
         "been more if out up would into has some time only very than its two first new after "
         "most also any many may then these great could other such made being where well").split()


def save_tiny_tokenizer(folder) -> None:
    """A word-level tokenizer over TINY_VOCAB ids, so the CLI can run the tiny models on text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
    vocab = {w: i for i, w in enumerate(specials + list(WORDS[: TINY_VOCAB - len(specials)]))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", bos_token="[BOS]",
                            eos_token="[EOS]", unk_token="[UNK]").save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch -> folder with config.json + model.safetensors of a tiny random model."""
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for arch in ARCHS:
        paths[arch] = root / arch
        make_tiny_model(arch).save_pretrained(paths[arch])
        save_tiny_tokenizer(paths[arch])
    return paths


@pytest.fixture(scope="session")
def fused_tiny():
    """arch -> (CompiledModel compiled as on CUDA: rbcompile's fused kernels and stacked
    projections, eager model) for the tiny configs."""
    import rbcompile

    out = {}
    for arch in ARCHS:
        eager = make_tiny_model(arch)
        out[arch] = (unguarded(rbcompile.compile(eager, kernels=True, stack_projections=True)),
                     eager)
    return out


@pytest.fixture(scope="session")
def compiled_tiny(tiny_checkpoints):
    """arch -> (CompiledModel, eager transformers model) for the tiny checkpoints."""
    import rbcompile
    from rbcompile.artifact.models import load_hf_model

    return {arch: (unguarded(rbcompile.compile(path)), load_hf_model(path))
            for arch, path in tiny_checkpoints.items()}


def random_batch(batch: int, seq: int, vocab: int = TINY_VOCAB, pad_row: bool = True, seed: int = 0):
    """Token ids and a mask; the last row is left-padded when pad_row and batch > 1."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    if pad_row and batch > 1:
        attention_mask[-1, : seq // 3] = 0
    return input_ids, attention_mask


def eager_outputs(model, input_ids, attention_mask) -> dict:
    kwargs = {"use_cache": False} if model.config.model_type != "bert" else {}
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def max_diff(compiled_out: dict, reference: dict) -> float:
    assert set(compiled_out) == set(reference), (set(compiled_out), set(reference))
    return max((compiled_out[k] - reference[k]).abs().max().item() for k in reference)


@pytest.fixture(scope="session")
def minilm():
    """(CompiledModel, eager model, tokenizer) for the real all-MiniLM-L6-v2 weights."""
    from transformers import AutoTokenizer

    import rbcompile
    from rbcompile.artifact.models import load_hf_model, resolve_checkpoint

    path = resolve_checkpoint("minilm-l6")
    return (unguarded(rbcompile.compile("minilm-l6")), load_hf_model(path),
            AutoTokenizer.from_pretrained(path))


def word_text(words: int, seed: int = 0) -> str:
    """Paragraphs of random words from the tiny tokenizer's vocabulary."""
    import random
    rng = random.Random(seed)
    return "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(words // 12))


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "words.txt"
    path.write_text(word_text(1500))
    return path


@pytest.fixture(scope="session")
def calibrated_tiny(tiny_checkpoints, calib_file):
    """arch -> CompiledModel calibrated on random word text (permuted, with width levels)."""
    import rbcompile
    return {arch: unguarded(rbcompile.compile(path, calib=calib_file, calib_samples=8,
                                              calib_seq=32))
            for arch, path in tiny_checkpoints.items()}


def labelled_words(path, lines: int = 100) -> None:
    """JSONL of random word texts with alternating labels."""
    import json
    texts = word_text(12 * lines).split("\n\n")
    path.write_text("\n".join(json.dumps({"text": t, "label": i % 2}) for i, t in enumerate(texts)))


@pytest.fixture(scope="session")
def task_bert(tiny_checkpoints, tmp_path_factory):
    """Tiny BERT calibrated on a random 2-class task head: plans plus early-exit off-ramps."""
    from safetensors.torch import save_file

    import rbcompile

    folder = tmp_path_factory.mktemp("task")
    torch.manual_seed(0)
    save_file({"weight": torch.randn(2, 32), "bias": torch.zeros(2)}, str(folder / "head.safetensors"))
    labelled_words(folder / "labelled.jsonl")
    return unguarded(rbcompile.compile(tiny_checkpoints["bert"], calib=folder / "labelled.jsonl",
                                       calib_samples=60, calib_seq=16,
                                       calib_head=folder / "head.safetensors"))


def text_streamed_through_sigterm(response, process) -> str:
    """Read an SSE completion stream, sending SIGTERM to the server `process` after its first
    event; the stream must still end with [DONE]. The text it carried."""
    import json
    import signal

    lines = response.iter_lines()
    events = [next(line for line in lines if line.startswith("data: "))]
    process.send_signal(signal.SIGTERM)
    events += [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in events[:-1])


def served_by_cli(monkeypatch) -> dict:
    """Stand in for the HTTP server of `rbcompile serve`: what the CLI would serve (app,
    bound socket, connection limits) lands in the returned dict, and nothing listens."""
    from rbcompile.runtime.serving import connections

    served = {}

    def capture(app, sock, limits):
        served.update(app=app, address=sock.getsockname()[:2], limits=limits)
        sock.close()

    monkeypatch.setattr(connections, "serve", capture)
    return served


def wait_for_health(base: str, process, timeout: float = 120) -> None:
    """Until `rbcompile serve` in `process` answers GET {base}/health (its stderr on failure)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return
        except httpx.ConnectError:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.2)
