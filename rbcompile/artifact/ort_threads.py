"""onnxruntime's thread pools for rbcompile's sessions.

By default each session has a pool of its own, whose workers spin on the cores for a while after
each run. Where sessions take turns (a draft step at a lower weight level, then the step that
verifies it; a batch's prefill graph, then its decode graph) the next one runs against the last
one's spinning workers (docs/executor.md, "One thread pool"). `share_threads` gives the process
one global pool instead. onnxruntime then refuses any session of the process not made with
`session_options`, so only a process that owns all its sessions turns it on: the CLI's `run`
and `serve`, and the benchmarks; a library user may call it too.
"""
from __future__ import annotations

_SHARED: list[int | None] = []   # the global pool's intra-op size, once made


def share_threads(threads: int | None = None) -> None:
    """Give this process's onnxruntime sessions one global pool of `threads` intra-op threads
    (None: one per core); later calls keep the first pool."""
    import onnxruntime

    if not _SHARED:
        onnxruntime.set_global_thread_pool_sizes(threads or 0, 1)
        _SHARED.append(threads)


def session_options(threads: int | None = None, *, spinning: bool = True):
    """Options for a session on the global pool where the process made one, else on a pool of
    `threads` intra-op threads (None: one per core) of its own, whose workers spin between ops
    unless `spinning` is False (idle sessions beside busy torch work)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    if _SHARED:
        options.use_per_session_threads = False
        return options
    options.intra_op_num_threads = threads or 0
    options.inter_op_num_threads = 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options
