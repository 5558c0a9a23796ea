"""`rbcompile run`: an artifact on text (generation, voting, labels, paths)."""
from __future__ import annotations

import sys

from rbcompile.errors import check_unicode
from rbcompile.frontend.cli.guard import _guard_from, _plan_line, _quality_guard, _use_executor

# Deferred on purpose: the commands import the rest of rbcompile (and torch) when they run,
# so the CLI starts, and handles Ctrl-C, before torch loads (see __init__._import_heavy).


def _cmd_run(args) -> None:
    from contextlib import nullcontext

    import rbcompile
    from rbcompile.errors import UserError
    from rbcompile.frontend.onnx_export import onnx_engine

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if args.onnx and args.engine != "onnxruntime":
        raise UserError("--onnx needs --engine onnxruntime")
    if any(not text.strip() for text in args.text):
        raise UserError("--text must not be empty")
    for text in args.text:
        check_unicode(text, "--text")
    model = rbcompile.load(args.artifact, device=args.device, dtype=args.dtype)
    _use_executor(model, args.executor, args.weights, _guard_from(args), args.prefill_weights)
    _quality_guard(args, model)   # after: which plans are measured depends on the weights
    model.complexity_threshold = args.complexity_threshold
    baked = None if args.budget is None else model.guarded(args.budget).budget  # what runs
    with (nullcontext(model) if args.engine == "torch"
          else onnx_engine(model, args.onnx, baked)) as engine:
        _run_texts(model, engine, args)


def _run_texts(model, engine, args) -> None:
    """Print what `engine` (the CompiledModel or an OnnxRunner of it) makes of each text."""
    import torch

    from rbcompile.artifact.quality import mean_pool
    from rbcompile.errors import UserError

    tokenizer = model.tokenizer
    if model.family == "decoder" and engine is model:
        _generate_texts(model, args)
        return
    if model.family == "decoder":
        for text in args.text:  # the ONNX export has no KV cache: the prefix runs per token
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            prompt_len = ids.shape[1]
            for _ in range(_new_tokens(model, prompt_len, args)):
                out = engine(ids, budget=args.budget)
                next_id = out["logits"][0, -1].argmax().cpu()
                ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
                if next_id.item() == tokenizer.eos_token_id:
                    break
            completion = tokenizer.decode(ids[0, prompt_len:], skip_special_tokens=True)
            print(f"{text!r} -> {completion!r}")
            print(_path_line(out) + (f", complexity {out.complexity[0]:.2f}" if out.complexity else ""))
        return
    lengths = [len(tokenizer(text)["input_ids"]) for text in args.text]
    if max(lengths) > model.max_positions:
        raise UserError(f"a text has {max(lengths)} tokens; the model has {model.max_positions} "
                        "positions")
    batch = tokenizer(args.text, return_tensors="pt", padding=True)
    out = engine(batch["input_ids"], batch["attention_mask"], budget=args.budget)
    if model.labels and "logits" in out:
        _print_labels(model, tokenizer, args.text, batch, out)
        return
    pooled = mean_pool(out["last_hidden_state"].float().cpu(), batch["attention_mask"])
    for i, text in enumerate(args.text):
        head = ", ".join(f"{v:+.3f}" for v in pooled[i, :6].tolist())
        print(f"{text!r}: mean-pooled embedding dim {pooled.shape[1]} [{head}, ...]")
    if len(args.text) > 1:
        sims = pooled @ pooled.T
        for i in range(len(args.text)):
            for j in range(i + 1, len(args.text)):
                print(f"  cosine(text {i + 1}, text {j + 1}) = {sims[i, j]:.4f}")
    print(_path_line(out))


def _path_line(out) -> str:
    """How a forward ran: its path, the FLOPs it skipped, and a budget the guard withheld."""
    withheld = f"; {out.plan.describe()}" if out.plan and out.plan.withheld else ""
    return f"  path {out.path}, skipped {out.skipped_flops:.1%} of prunable FLOPs{withheld}"


def _print_labels(model, tokenizer, texts, batch, out) -> None:
    """A classifier artifact: each text's predicted label and its probability (token
    classification: each real token's)."""
    probs = out["logits"].float().cpu().softmax(-1)
    best, index = probs.max(-1)
    for i, text in enumerate(texts):
        if probs.dim() == 2:
            print(f"{text!r}: {model.labels[index[i]]} (p={best[i]:.3f})")
            continue
        real = batch["attention_mask"][i].bool()
        tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][i][real].tolist())
        tagged = " ".join(f"{token}/{model.labels[label]} ({p:.3f})" for token, label, p in
                          zip(tokens, index[i][real].tolist(), best[i][real].tolist()))
        print(f"{text!r}: {tagged}")
    print(_path_line(out))


def _new_tokens(model, prompt_len: int, args) -> int:
    """--max-new-tokens clipped, with a warning line, to the positions the prompt leaves; a
    prompt that leaves none is refused."""
    from rbcompile.errors import UserError

    room = model.max_positions - prompt_len
    if room < 1:
        raise UserError(f"the prompt has {prompt_len} tokens; the model has "
                        f"{model.max_positions} positions, so at most "
                        f"{model.max_positions - 1} prompt tokens can be continued")
    if args.max_new_tokens > room:
        print(f"rbcompile: warning: --max-new-tokens {args.max_new_tokens} clipped to "
              f"{room} (the model's {model.max_positions} positions minus the "
              f"{prompt_len}-token prompt)", file=sys.stderr)
    return min(args.max_new_tokens, room)


def _generate_texts(model, args) -> None:
    """Decoders on the torch engine: KV-cached generation, one text at a time."""
    from rbcompile.artifact.guard import DECODER

    sampling = [args.temperature, args.top_k, args.top_p]
    if args.consistency != "off":
        return _vote_texts(model, args)
    for text in args.text:
        ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
        result = model.generate(
            ids, max_new_tokens=_new_tokens(model, ids.shape[1], args), budget=args.budget,
            speculate=args.speculate, do_sample=any(v is not None for v in sampling),
            temperature=1.0 if args.temperature is None else args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        stats = result.stats
        completion = model.tokenizer.decode(result.tokens[0], skip_special_tokens=True)
        print(f"{text!r} -> {completion!r}")
        drafted = (f", {stats.accepted}/{stats.drafted} drafts accepted "
                   f"({stats.mean_accepted_length:.2f} tokens per step)" if stats.drafted else "")
        print(f"  {stats.new_tokens} tokens in {stats.seconds:.2f} s = "
              f"{stats.tokens_per_second:.1f} tokens/s (KV cache, speculate {args.speculate}"
              f"{drafted})")
        if args.budget:
            print(f"  {_plan_line(model, args.budget, DECODER)}")


def _vote_texts(model, args) -> None:
    """Decoders with --consistency k: k samples per text, their answers (--extract) voted."""
    from rbcompile.errors import UserError
    from rbcompile.runtime.engine.consistency import VoteOptions

    k = args.consistency if args.consistency == "auto" else int(args.consistency)
    if k != 1 and args.temperature is None:
        raise UserError(f"--consistency {k} needs --temperature (greedy samples are all the same)")
    for text in args.text:
        ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
        result = model.generate(
            ids, max_new_tokens=_new_tokens(model, ids.shape[1], args), budget=args.budget,
            do_sample=args.temperature is not None,
            temperature=1.0 if args.temperature is None else args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, speculate=args.speculate,
            consistency=k, vote=VoteOptions(extract=args.extract,
                                            tier_weights=args.tier_weights))
        stats = result.stats
        votes = ", ".join(f"{answer!r}: {count}" for answer, count in result.votes.items())
        print(f"{text!r} -> {result.answer!r}")
        tier = "" if stats.tier is None else \
            f"router: tier {stats.tier} (greedy + {stats.tier - 1} samples); "
        tier += "" if stats.weights is None else f"{stats.weights} weights; "
        print(f"  {tier}votes {{{votes}}} from {stats.voted} of {stats.samples} answers"
              f"{' (stopped early)' if stats.stopped_early else ''}; {stats.prefills} prefill, "
              f"{stats.new_tokens} tokens in {stats.seconds:.2f} s")
