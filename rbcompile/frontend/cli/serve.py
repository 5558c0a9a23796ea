"""`rbcompile serve`: the HTTP server (or Ray replicas) on an artifact."""
from __future__ import annotations

import os
import signal
import sys
import threading
from functools import partial

from rbcompile.frontend.cli.guard import (
    _guard_from,
    _guard_leaves,
    _quality_guard,
    _serving_budgets,
    _use_executor,
)
from rbcompile.frontend.cli.serve_options import limits_from, serve_config

# Deferred on purpose: the commands import the rest of rbcompile (and torch) when they run,
# so the CLI starts, and handles Ctrl-C, before torch loads (see __init__._import_heavy).


def _cmd_serve(args) -> None:
    import rbcompile
    from rbcompile.errors import UserError

    api_key = _serve_api_key(args)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0-65535, got {args.port}")
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    for option in ("prefix_cache_mb", "result_cache_mb"):
        if not getattr(args, option) >= 0:
            raise UserError(f"--{option.replace('_', '-')} must be >= 0, got {getattr(args, option)}")
    if args.prefill_chunk < 0:
        raise UserError(f"--prefill-chunk must be >= 0 (0: never chunk), got {args.prefill_chunk}")
    if args.quality_check_every < 0:
        raise UserError(f"--quality-check-every must be >= 0, got {args.quality_check_every}")
    if args.ray:
        return _serve_ray(args, serve_config(args, api_key))
    if args.replicas is not None or args.ray_address or args.replica_cpus is not None:
        raise UserError("--replicas, --ray-address and --replica-cpus go with --ray")
    try:
        from rbcompile.artifact.executors import prepare_level
        from rbcompile.runtime.control.levers import served_ladder
        from rbcompile.runtime.serving import connections
        from rbcompile.runtime.serving.http import create_app
        from rbcompile.runtime.serving.serve_policy import build_policy
    except ImportError as exc:
        raise UserError(f"rbcompile serve needs the 'serve' extra ({exc.name} is missing): "
                        "pip install 'rbcompile[serve]'") from None
    config, connection_limits = serve_config(args, api_key), limits_from(args)[1]
    sock = connections.bind(args.host, args.port)   # a port in use: refused before loading
    model = rbcompile.load(args.artifact, device=args.device, dtype=args.dtype)
    executor = _use_executor(model, _executor(args, config.executor), config.weights,
                             _guard_from(args), config.prefill_weights)
    _quality_guard(args, model)   # after: which plans are measured depends on the weights
    if args.compile_plans:
        model.compile_plans()
    if args.cuda_graphs:
        model.use_cuda_graphs()
    levels = served_ladder(model) if config.policy.policy == "pid" else ()
    for level in levels:   # its sessions now: not in the first step under load
        prepare_level(model, level)
    policy = build_policy(config.policy, max(_serving_budgets(model), default=0.0), levels)
    app = create_app(model, config, policy=policy)
    print(f"quality guard: max quality loss {args.max_quality_loss:g}; {_guard_leaves(model)}",
          file=sys.stderr)
    if model.decoder is not None:
        print(f"decode steps: {executor} executor, {model.decoder.weights} weights, prompts "
              f"prefilled at {model.decoder.prefill}"
              + (f"; under load pid lowers them to {', then '.join(levels)} before it skips"
                 if levels else ""), file=sys.stderr)
    print(f"serving {model.manifest['source']['name']} ({model.family}) on "
          f"http://{args.host}:{sock.getsockname()[1]}/v1", file=sys.stderr)
    _serve_until_signalled(partial(connections.serve, app, sock, connection_limits))


def _executor(args, executor: str) -> str:
    """--compile-plans and --cuda-graphs are ways of running the torch executor."""
    from rbcompile.errors import UserError

    if not (args.compile_plans or args.cuda_graphs):
        return executor
    if executor == "onnxruntime":
        raise UserError("--compile-plans and --cuda-graphs run the torch executor; drop them "
                        "or --executor onnxruntime")
    return "torch"


def _serve_ray(args, config) -> None:
    """`serve --ray`: replicas under Ray Serve, one controller (runtime/serving/ray_serving.py)."""
    from rbcompile.errors import UserError
    from rbcompile.runtime.serving.ray_serving import import_ray, serve_on_ray

    if args.device or args.dtype or args.compile_plans or args.cuda_graphs:
        raise UserError("--device, --dtype, --compile-plans and --cuda-graphs are not passed "
                        "to Ray replicas (they load the artifact on CPU as compiled); drop them "
                        "or --ray")
    args.replicas = 2 if args.replicas is None else args.replicas
    args.replica_cpus = 1.0 if args.replica_cpus is None else args.replica_cpus
    if args.replicas < 1 or not args.replica_cpus > 0:
        raise UserError("--replicas must be >= 1 and --replica-cpus > 0")
    import_ray()  # the one-line error without the extra, before anything starts
    from dataclasses import replace
    from pathlib import Path

    from rbcompile.artifact import manifest
    from rbcompile.artifact.executors import check_precision, resolve_levels

    stored, guard = manifest.read(Path(args.artifact)), _guard_from(args)
    levels = resolve_levels(stored, config.weights, config.prefill_weights, guard,
                            config.executor != "torch")   # replicas load on the CPU
    config = replace(config, weights=levels.weights, prefill_weights=levels.prefill)
    check_precision(stored, config.weights, guard, config.prefill_weights)
    serve_on_ray(args, config)


def _serve_until_signalled(serve) -> None:
    """Run `serve` (uvicorn, which drains on SIGINT / SIGTERM: no new connections, open
    requests finished, then the app's shutdown) and end normally after a drain: uvicorn
    replays the signal it caught to the handlers it found, here ones that only note it."""
    noted = []
    held = ({signum: signal.signal(signum, lambda number, frame: noted.append(number))
             for signum in (signal.SIGINT, signal.SIGTERM)}
            if threading.current_thread() is threading.main_thread() else {})
    try:
        serve()
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)


def _serve_api_key(args) -> str | None:
    """The API key of --api-key, or the one named by --api-key-env; refused when that
    variable is unset, or missing when binding a non-loopback address."""
    import ipaddress

    from rbcompile.errors import UserError

    if args.api_key is not None and args.api_key_env:
        raise UserError("give --api-key or --api-key-env, not both")
    if args.api_key is not None:
        if not args.api_key.strip():
            raise UserError("--api-key is empty")
        return args.api_key
    if args.api_key_env:
        key = os.environ.get(args.api_key_env, "")
        if not key:
            raise UserError(f"--api-key-env {args.api_key_env}: that environment variable is "
                            "not set or empty")
        return key
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UserError(f"--host {args.host} is not a loopback address: serving it needs an API "
                        "key (--api-key KEY, or --api-key-env VAR with the key in $VAR)")
    return None
