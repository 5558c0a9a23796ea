"""The KV-cached generation engine, run on the eager decoder step (transformers' StaticCache
fed with the engine's tensors): greedy parity with HF `generate` for every speculation mode,
rows leaving the batch, cache rollback after rejected drafts, sampling reproducibility and
distribution, stop strings, bad input, and `auto` falling back to plain decoding."""
import functools
import time

import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_model
from transformers import StaticCache

from rbcompile.artifact.decoder import DecoderShape
from rbcompile.compiler.trace import cache_keyword
from rbcompile.errors import UserError
from rbcompile.runtime.engine.draft_policy import AutoPolicy
from rbcompile.runtime.engine.drafters import NGramDrafter
from rbcompile.runtime.engine.generation import generate, stream
from rbcompile.runtime.engine.sampling import SamplingConfig

EOS = 2
LIGHT_GATES = [True, False, True, False]   # the light path skips the MLPs of layers 1 and 3


class KVWrapper(torch.nn.Module):
    """The decoder step on a transformers model: its StaticCache layers are the engine's tensors."""

    def __init__(self, model, max_len):
        super().__init__()
        self.model, self.max_len = model, max_len

    def forward(self, input_ids, attention_mask, position_ids, cache_position, logit_positions, *kv):
        cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        start = cache_position[0].clone()
        for i, layer in enumerate(cache.layers):
            k, v = kv[2 * i], kv[2 * i + 1]
            layer.keys, layer.values, layer.device = k, v, k.device
            layer.batch_size, layer.num_heads = k.shape[:2]
            layer.k_head_dim, layer.v_head_dim = k.shape[-1], v.shape[-1]
            layer.cumulative_length = start.clone()
            layer.is_initialized = True
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=True, logits_to_keep=logit_positions,
                          **{cache_keyword(self.model): cache}).logits


def _zeros(hidden, *args, **kwargs):
    return torch.zeros_like(hidden)


def eager_step(model, input_ids, attention_mask, position_ids, cache_position, logit_positions, kv,
               gates=None):
    """The step interface; `gates` False skips that layer's MLP (identity on the residual)."""
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    skipped = [layer.mlp for layer, keep in zip(layers, gates or ()) if not keep]
    for mlp in skipped:
        mlp.forward = _zeros
    try:
        return KVWrapper(model, kv[0].shape[2])(input_ids, attention_mask, position_ids,
                                                cache_position, logit_positions, *kv)
    finally:
        for mlp in skipped:
            del mlp.forward


class Recorder:
    """A step that records (rows, tokens, first slot) of each call."""

    def __init__(self, step):
        self.step, self.calls = step, []

    def __call__(self, input_ids, attention_mask, position_ids, cache_position, logit_positions, kv,
                 gates=None):
        self.calls.append((input_ids.shape[0], input_ids.shape[1], int(cache_position[0])))
        return self.step(input_ids, attention_mask, position_ids, cache_position, logit_positions,
                         kv, gates=gates)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and lose much when the cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    return {arch: make_tiny_model(arch) for arch in ("llama", "gpt2")}


def run(model, prompts, **options):
    """generate() on the eager step of `model` from a list of prompts (left-padded)."""
    ids, mask = left_pad(prompts)
    step = functools.partial(eager_step, model)
    options.setdefault("eos_token_ids", [EOS])
    if options.get("speculate") in ("self", "auto"):
        options.setdefault("draft_step", functools.partial(step, gates=LIGHT_GATES))
        options.setdefault("draft_threshold", 0.0)   # random tiny models: flat distributions
    return generate(step, ids, mask, shape=DecoderShape.from_config(model.config), **options)


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf_tokens(model, prompts, max_new_tokens, eos=EOS):
    """HF generate(do_sample=False)'s new tokens per row, up to and including EOS."""
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=eos)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        rows.append(row[:row.index(eos) + 1] if eos in row else row)
    return rows


BATCH = [[5, 17, 33, 5, 17, 40, 5, 17], [60, 61, 62], [9, 8, 7, 6, 9, 8]]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_single_prompt_matches_hf_generate(models, arch):
    prompt = [[11, 12, 13, 14, 15]]
    assert run(models[arch], prompt, max_new_tokens=12).tokens == hf_tokens(models[arch], prompt, 12)


@pytest.mark.parametrize("speculate", ["off", "ngram", "self", "auto"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_batch_matches_hf_generate_in_every_mode(models, arch, speculate):
    result = run(models[arch], BATCH, max_new_tokens=12, speculate=speculate)
    assert result.tokens == hf_tokens(models[arch], BATCH, 12)
    assert result.sequences == [p + t for p, t in zip(BATCH, result.tokens)]
    if speculate in ("ngram", "self"):
        assert result.stats.drafted > 0


def test_finished_rows_leave_the_batch(models):
    model = models["llama"]
    free = run(model, BATCH, max_new_tokens=10, eos_token_ids=[]).tokens
    eos = free[1][3]            # row 1 ends at its 4th token
    step = Recorder(functools.partial(eager_step, model))
    ids, mask = left_pad(BATCH)
    events = stream(step, ids, mask, shape=DecoderShape.from_config(model.config),
                    max_new_tokens=10, eos_token_ids=[eos])
    streamed = [[], [], []]
    for row, token in events:
        streamed[row].append(token)
    result = events.result()
    assert result.tokens == streamed == hf_tokens(model, BATCH, 10, eos=eos)
    assert len(result.tokens[1]) == 4 and result.tokens[1][-1] == eos
    rows = [rows for rows, _, _ in step.calls]
    assert rows == result.stats.rows_per_step
    assert rows[0] == 3 and rows[-1] < 3 and rows == sorted(rows, reverse=True)
    assert result.stats.new_tokens == sum(map(len, result.tokens))


def test_rejected_first_draft_rolls_the_cache_back(models):
    """'15' recurs, so the first decode step drafts what followed it; the model disagrees, the
    next step starts one slot later (the drafts' slots are dropped), and later drafts are kept."""
    model = models["llama"]
    prompt = [[15, 47, 81, 60, 71, 81, 76, 15]]
    step = Recorder(functools.partial(eager_step, model))
    ids, mask = left_pad(prompt)
    result = generate(step, ids, mask, shape=DecoderShape.from_config(model.config),
                      max_new_tokens=16, speculate="ngram")
    assert result.tokens == run(model, prompt, max_new_tokens=16, eos_token_ids=[]).tokens
    (_, prefill, _), (_, first_decode, first_slot), (_, _, second_slot) = step.calls[:3]
    assert prefill == 8 and first_decode > 1 and (first_slot, second_slot) == (8, 9)
    assert 0 < result.stats.accepted < result.stats.drafted
    assert result.stats.forward_calls < 16


def test_self_speculation_drafts_on_the_light_path(models):
    model = models["gpt2"]
    light = Recorder(functools.partial(eager_step, model, gates=LIGHT_GATES))
    result = run(model, BATCH, max_new_tokens=12, speculate="self", draft_step=light)
    assert result.tokens == hf_tokens(model, BATCH, 12)
    assert light.calls and result.stats.accepted > 0
    assert result.stats.mean_accepted_length > 1


@pytest.mark.parametrize("speculate", ["off", "ngram", "self"])
def test_seeded_sampling_is_reproducible(models, speculate):
    def sample(seed):
        config = SamplingConfig(do_sample=True, temperature=0.8, top_k=20, seed=seed)
        return run(models["llama"], BATCH, max_new_tokens=8, sampling=config, speculate=speculate).tokens

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


# A prompt (from the peaked model below) where every possible first token has an n-gram draft
# for the second, kept about half the time.
SAMPLED_PROMPT = [56, 14, 69, 51, 90, 57, 40, 81, 45, 40, 81, 45, 27, 57, 13, 25]


def test_speculative_sampling_keeps_the_distribution():
    """The second token's frequencies over 2000 sampled rows, without drafts, with n-gram
    drafts (one-hot) and with light-path drafts (their distributions), stay within sampling noise (total variation about 0.015) of the exact distribution, which
    always keeping the draft would miss by 0.5."""
    model = make_tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(40)   # peaked distributions
    config = SamplingConfig(do_sample=True, top_k=3, seed=0)
    exact = _second_token_distribution(model, config, SAMPLED_PROMPT)
    rows = [SAMPLED_PROMPT] * 2000
    for speculate in ("off", "ngram", "self"):
        result = run(model, rows, max_new_tokens=3, sampling=config, speculate=speculate, eos_token_ids=[])
        frequencies = torch.bincount(torch.tensor([t[1] for t in result.tokens]), minlength=TINY_VOCAB) / len(rows)
        assert 0.5 * (frequencies - exact).abs().sum() < 0.06, speculate
        drafts = [NGramDrafter(SAMPLED_PROMPT + t[:1]).propose(1) for t in result.tokens]
        kept = sum(d == t[1:2] for d, t in zip(drafts, result.tokens)) / len(rows)
        assert 0.3 < kept < 0.7, speculate   # the draft is right about half the time
        if speculate != "off":
            assert result.stats.drafted == len(rows)


def _second_token_distribution(model, config, prompt):
    with torch.no_grad():
        first = config.probabilities(model(torch.tensor([prompt])).logits[0, -1])
        exact = torch.zeros(TINY_VOCAB)
        for token in first.nonzero().flatten().tolist():
            logits = model(torch.tensor([prompt + [token]])).logits[0, -1]
            exact += first[token] * config.probabilities(logits)
    return exact


def letters(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_cut_the_output(models):
    model = models["llama"]
    free = run(model, BATCH, max_new_tokens=12, eos_token_ids=[])
    stop = letters(free.tokens[0][4:6])            # row 0 stops at (or before) its 6th token
    result = run(model, BATCH, max_new_tokens=12, eos_token_ids=[], stop=[stop], decode=letters)
    for row, full in enumerate(free.tokens):
        text = letters(full)
        if stop not in text:
            assert result.tokens[row] == full and result.texts[row] == text
            continue
        end = text.index(stop) + len(stop)
        assert result.texts[row] == text[:end]
        assert result.tokens[row] == full[:end]    # one letter per token
    assert len(result.tokens[0]) <= 6


@pytest.mark.parametrize("options,message", [
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "the prompt is empty (0 tokens)"),
    (dict(attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), "prompt row 1 is empty"),
    (dict(attention_mask=torch.tensor([[1, 1, 1], [1, 0, 1]])), "attention_mask must be left padding"),
    (dict(input_ids=torch.ones(1, 64, dtype=torch.long)),
     "the prompt has 64 tokens; the model allows fewer than 64 positions"),
    (dict(max_new_tokens=0), "max_new_tokens must be between 1 and the 61 positions left after the "
                             "3-token prompt (max positions 64), got 0"),
    (dict(max_new_tokens=62), "max_new_tokens must be between 1 and the 61 positions left"),
    (dict(speculate="eagle"), "unknown speculate='eagle'; valid: off, ngram, self, quant, auto"),
    (dict(speculate="self"), "speculate='self' needs a draft_step (the light path)"),
    (dict(stop=["x"]), "stop strings need a decode function"),
    (dict(sampling_options=dict(do_sample=True, temperature=0)), "temperature must be > 0"),
])
def test_bad_input_is_a_one_line_user_error(models, options, message):
    calls = []
    inputs = dict(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), attention_mask=None,
                  max_new_tokens=4)
    inputs.update(options)
    with pytest.raises(UserError) as error:
        sampling = SamplingConfig(**inputs.pop("sampling_options", {}))
        stream(lambda *args, **kwargs: calls.append(args), inputs.pop("input_ids"),
               inputs.pop("attention_mask"), shape=DecoderShape.from_config(models["llama"].config),
               sampling=sampling, **inputs)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert not calls


class StrideModel:
    """A fake step: after token t comes (t + stride) mod vocab, with certainty. Each call takes
    2 ms and 1 ms more per token past the first, as a forward would, so auto's timings are not
    noise from a busy machine."""

    def __init__(self, stride):
        self.stride = stride

    def __call__(self, input_ids, attention_mask, position_ids, cache_position, logit_positions, kv,
                 gates=None):
        time.sleep(0.001 + 0.001 * input_ids.shape[1])
        following = (input_ids[:, logit_positions] + self.stride) % TINY_VOCAB
        return torch.nn.functional.one_hot(following, TINY_VOCAB).float() * 20


FAKE_SHAPE = DecoderShape(layers=1, kv_heads=1, head_dim=1, max_positions=512)
EVERY_TOKEN = [(5 * i + 3) % TINY_VOCAB for i in range(TINY_VOCAB)]   # n-grams of stride 5


@pytest.mark.parametrize("stride,drafts_match", [(37, False), (5, True)])
def test_auto_keeps_speculation_only_when_it_pays(stride, drafts_match):
    """Every token has an n-gram draft (stride 5) and the light path is always confident. With
    drafts that never match (the model's stride is 37, the light path's is off by one), auto's
    steps fall back to plain decoding; with matching drafts (stride 5), it speculates."""
    light = StrideModel(stride if drafts_match else stride + 1)
    new = 90   # fewer than the vocabulary: the output never repeats itself
    result = generate(StrideModel(stride), EVERY_TOKEN, shape=FAKE_SHAPE, max_new_tokens=new,
                      speculate="auto", draft_step=light)
    expected = [(EVERY_TOKEN[-1] + stride * (i + 1)) % TINY_VOCAB for i in range(new)]
    assert result.tokens == [expected]
    stats = result.stats
    speculative = stats.steps_by_mode.get("ngram", 0) + stats.steps_by_mode.get("self", 0)
    if drafts_match:
        assert stats.acceptance_rate > 0.9 and speculative > 0.7 * stats.decode_steps
    else:
        assert stats.drafted > 0 and stats.accepted == 0
        assert stats.steps_by_mode["off"] > 0.85 * stats.decode_steps, stats.steps_by_mode


def run_policy(policy, steps, step_seconds, accepted):
    """Drive `policy` for `steps` steps: a step of mode m takes `step_seconds[m]` and keeps
    `accepted[m]` of its 4 drafts. Returns the modes it chose."""
    chosen = []
    for _ in range(steps):
        mode = policy.choose()
        drafted = 0 if mode == "off" else 4
        policy.record(mode, 1 + accepted.get(mode, 0), step_seconds[mode], drafted, accepted.get(mode, 0))
        chosen.append(mode)
    return chosen


def test_auto_measures_a_costly_drafter_only_within_its_share():
    """An unmeasured light path that may cost its 4 draft forwards is not tried before its
    share of the budget (2% of the elapsed time with two drafters) can pay for that; n-gram
    drafts (no extra forward) are tried at once, and the light path's measurements never stop
    n-gram's from being retried."""
    policy = AutoPolicy(["off", "ngram", "self"], {"self": 4.0})
    chosen = run_policy(policy, 400, {"off": 0.1, "ngram": 0.11, "self": 0.5},
                        {"ngram": 0, "self": 0})
    assert chosen[:2] == ["off", "ngram"]
    assert "self" not in chosen[:190]   # its 4 steps of loss (0.4 s) fit 2% of 20 s: ~200 steps
    lost = {mode: policy.lost[mode] for mode in ("ngram", "self")}
    assert all(loss <= 0.02 * policy.elapsed for loss in lost.values()), lost
    probes = [i for i, mode in enumerate(chosen) if mode == "ngram"]
    assert len(probes) > 40 and max(b - a for a, b in zip(probes, probes[1:])) <= 10
    assert policy.elapsed <= 1.04 * 400 * 0.1 + 0.11   # 4% slower than plain decoding at most (+ n-gram's first step)


def test_auto_runs_a_paying_drafter_it_has_measured():
    policy = AutoPolicy(["off", "ngram"])
    chosen = run_policy(policy, 50, {"off": 0.1, "ngram": 0.12}, {"ngram": 3})
    assert chosen[:2] == ["off", "ngram"] and chosen[2:].count("ngram") > 0.85 * 48


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rows_keep_different_numbers_of_drafts(models, arch):
    """Self-drafting on a batch: rows keep different numbers of drafts in one step, the cache
    masks each row's rejected slots (holes past its pads), and every row's tokens are still
    HF generate's."""
    model = models[arch]
    ids, mask = left_pad(BATCH)
    light = functools.partial(eager_step, model, gates=LIGHT_GATES)
    events = stream(functools.partial(eager_step, model), ids, mask, eos_token_ids=[EOS],
                    shape=DecoderShape.from_config(model.config), max_new_tokens=16,
                    speculate="self", draft_step=light, draft_threshold=0.0)
    kept_per_step = []
    engine = events.engine
    verify = engine._verify

    def recording(logits, proposals):
        emitted = verify(logits, proposals)
        kept_per_step.append([len(tokens) - 1 for tokens in emitted])
        return emitted

    engine._verify = recording
    result = generate_all(events)
    assert result.tokens == hf_tokens(model, BATCH, 16)
    assert any(len(set(kept)) > 1 for kept in kept_per_step)           # rows kept different counts
    assert engine.cache.skipped.sum() > 0     # holes: slots of drafts a row rejected, masked


def generate_all(events):
    for _ in events:
        pass
    return events.result()
