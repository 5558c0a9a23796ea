"""`rbcompile serve`'s options as typed objects: the limits on requests, clients and
connections (`ServeLimits` / `ConnectionLimits`), and the `ServeConfig` of all of them, made
once and handed to the app and to Ray replicas."""
from __future__ import annotations

import argparse

# Deferred on purpose: the commands import the rest of rbcompile (and torch) when they run,
# so the CLI starts, and handles Ctrl-C, before torch loads (see __init__._import_heavy).


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    """The limit options of `serve` (their defaults are the dataclasses')."""
    from rbcompile.runtime.serving.limits import ConnectionLimits, ServeLimits

    serve, conn = ServeLimits(), ConnectionLimits()
    group = parser.add_argument_group("limits (a request over one gets a 4xx; a client or "
                                      "connection over one a 429 / 503)")
    group.add_argument("--max-body-bytes", type=int, default=serve.max_body_bytes,
                       help=f"largest request body (default {serve.max_body_bytes})")
    group.add_argument("--max-tokens-limit", type=int, default=serve.max_tokens_limit,
                       help=f"largest max_tokens a completion may ask for (default {serve.max_tokens_limit})")
    group.add_argument("--max-choices", type=int, default=serve.max_choices, metavar="N",
                       help=f"prompts x n in one request (default {serve.max_choices})")
    group.add_argument("--max-queue", type=int, default=serve.max_queue, metavar="N",
                       help=f"choices waiting for a batch row, over all clients (default {serve.max_queue})")
    group.add_argument("--max-client-choices", type=int, default=serve.max_client_choices,
                       metavar="N", help="choices one client address may have queued or running "
                       f"(default {serve.max_client_choices}; 0: no limit)")
    group.add_argument("--max-connections", type=int, default=conn.max_connections, metavar="N",
                       help="open connections (default 0: the file-descriptor limit less "
                       "128, at most 4096)")
    group.add_argument("--max-client-connections", type=int, default=conn.max_client_connections,
                       metavar="N", help="open connections from one client address (default "
                       f"{conn.max_client_connections}; 0: no limit)")
    group.add_argument("--header-timeout", type=float, default=conn.header_timeout_s, metavar="S",
                       help=f"seconds for a request's headers to arrive (default {conn.header_timeout_s:g})")
    group.add_argument("--body-timeout", type=float, default=serve.body_timeout_s, metavar="S",
                       help=f"seconds for a request's body to arrive (default {serve.body_timeout_s:g})")
    group.add_argument("--keep-alive-timeout", type=float, default=conn.keep_alive_s, metavar="S",
                       help=f"seconds an idle connection is kept (default {conn.keep_alive_s:g})")
    group.add_argument("--drain-timeout", type=float, default=conn.drain_timeout_s, metavar="S",
                       help="on SIGTERM / SIGINT, seconds the open requests may take before "
                       f"they are cut and the server exits 0 (default {conn.drain_timeout_s:g})")


def limits_from(args: argparse.Namespace):
    """(ServeLimits, ConnectionLimits) of parsed options; a one-line UserError when out of range."""
    from rbcompile.runtime.serving.limits import ConnectionLimits, ServeLimits

    serve = ServeLimits(max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                        max_choices=args.max_choices, max_queue=args.max_queue,
                        max_client_choices=args.max_client_choices, body_timeout_s=args.body_timeout)
    connections = ConnectionLimits(max_connections=args.max_connections,
                                   max_client_connections=args.max_client_connections,
                                   header_timeout_s=args.header_timeout,
                                   keep_alive_s=args.keep_alive_timeout,
                                   drain_timeout_s=args.drain_timeout)
    return serve, connections


def serve_config(args: argparse.Namespace, api_key: str | None):
    """The ServeConfig of parsed options (runtime/serving/serve_config.py)."""
    from pathlib import Path

    from rbcompile.frontend.cli.guard import _guard_from
    from rbcompile.runtime.control.quality_loop import QualityLoopConfig
    from rbcompile.runtime.serving.serve_config import ServeConfig
    from rbcompile.runtime.serving.serve_policy import PolicyOptions

    name = args.served_model_name or Path(args.artifact).resolve().name
    return ServeConfig(api_key=api_key, served_model_name=name,
                       public_metrics=args.public_metrics,
                       limits=limits_from(args)[0], max_batch=args.max_batch,
                       prefix_cache_mb=args.prefix_cache_mb,
                       prefill_chunk=args.prefill_chunk or None,
                       result_cache_mb=args.result_cache_mb,
                       policy=PolicyOptions(args.policy, args.budget, args.slo_ms, args.policy_file),
                       guard=_guard_from(args),
                       quality_loop=QualityLoopConfig(check_every=args.quality_check_every),
                       executor=args.executor, weights=args.weights,
                       prefill_weights=args.prefill_weights,
                       tier_weights=args.tier_weights)
