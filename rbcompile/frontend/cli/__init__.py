"""The `rbcompile` command. Exit codes: 0 ok, 2 bad input or usage, 1 internal error,
130 interrupted (SIGINT), 143 terminated (SIGTERM); an interrupted command leaves its output as
it was before."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from rbcompile.artifact.atomic import commits, note_stop
from rbcompile.errors import first_line
from rbcompile.frontend.cli.commands import (
    _cmd_compile,
    _cmd_curve,
    _cmd_export_onnx,
    _cmd_inspect,
    _cmd_models,
    _cmd_train_policy,
    _cmd_verify,
)
from rbcompile.frontend.cli.parser import EXIT_USAGE, _build_parser
from rbcompile.frontend.cli.run import _cmd_run
from rbcompile.frontend.cli.serve import _cmd_serve

# Deferred on purpose: the commands import the rest of rbcompile (and torch) when they run,
# so the CLI starts, and handles Ctrl-C, before torch loads (see __init__._import_heavy).

EXIT_OK, EXIT_INTERNAL, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 130, 143


DEFER_S = 0.05  # a signal that lands in an import comes again this much later


def _importing(frame) -> bool:
    """Whether `frame` runs inside an import (importlib's frames are below it): an exception
    raised there may cross a C extension's initialisation (torch's), which aborts the process
    (`terminate called after throwing an instance of 'pybind11::error_already_set'`)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is, so clean-up runs as for Ctrl-C."""


class _Stop:
    """SIGINT / SIGTERM handler of one command: the first signal raises (KeyboardInterrupt /
    Terminated) and is remembered, later ones are ignored so clean-up finishes. A library that
    turns the exception into its own error (transformers' lazy imports do) still ends the
    command with the signal's exit code; code that swallows it gets it back before an output is
    put in place (`atomic.note_stop`). The records libraries log while the command
    unwinds are dropped: a stopped command prints one line (torch's fake tensors log the
    TypeError a C++ binding may make of the KeyboardInterrupt, with its traceback). Once the
    command's output is in place (`atomic.commit_output`) or the command has ended, a signal
    changes nothing: "stopped" would be false, and the exit code stands."""

    def __init__(self):
        self.received = None
        self.ended = False
        self.commits = commits()
        self.logging_level = None  # what logging.disable was before a signal turned it off

    def __call__(self, signum, frame):
        if self.received is not None or self.ended or commits() != self.commits:
            return
        if _importing(frame):  # a module's top level may run under C++ that cannot unwind
            threading.Timer(DEFER_S, os.kill, (os.getpid(), signum)).start()
            return
        self.received = signum
        self.logging_level = logging.root.manager.disable
        logging.disable(logging.CRITICAL)
        stop = KeyboardInterrupt() if signum == signal.SIGINT else Terminated()
        note_stop(stop)  # raised again before an output is put in place, should it be swallowed
        raise stop

    def install(self) -> dict:
        """Make this the SIGINT / SIGTERM handler (main thread only); returns the ones before."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self) for signum in (signal.SIGINT, signal.SIGTERM)}

    def restore_logging(self) -> None:
        """Logging as it was before the signal (if one came)."""
        if self.logging_level is not None:
            logging.disable(self.logging_level)

    def exit_code(self) -> int | None:
        return {signal.SIGINT: EXIT_SIGINT, signal.SIGTERM: EXIT_SIGTERM}.get(self.received)


def _import_libraries() -> None:
    """Import torch and transformers with SIGINT / SIGTERM held: a signal inside their native
    initialisation can abort the process (or leave an interrupt pending past our handler);
    held, it is delivered right after, as a clean KeyboardInterrupt / Terminated."""
    from rbcompile.artifact.atomic import signals_held

    with signals_held():
        import torch  # noqa: F401
        import transformers  # noqa: F401


COMMANDS = {"compile": _cmd_compile, "inspect": _cmd_inspect, "run": _cmd_run,
            "export-onnx": _cmd_export_onnx, "verify": _cmd_verify,
            "curve": _cmd_curve, "train-policy": _cmd_train_policy, "serve": _cmd_serve,
            "models": _cmd_models}


def main(argv=None) -> int:
    """Run one command in this process and return its exit code; its SIGINT / SIGTERM handler
    is in place while it runs, and the earlier ones are put back (unless a signal came: then
    `stop` stays, as a library may re-trip SIGINT while Python exits); logging is as it was."""
    stop = _Stop()
    previous = stop.install()
    try:
        return _run(argv, stop)
    finally:
        stop.restore_logging()
        for signum, handler in previous.items() if stop.received is None else ():
            signal.signal(signum, handler)


def _run(argv, stop: _Stop) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rbcompile.errors import UserError
    try:
        try:
            args = _build_parser().parse_args(argv)
        except SystemExit as exc:  # usage errors (exit 2), --help and --version (exit 0)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        if args.command != "models" and threading.current_thread() is threading.main_thread():
            _import_libraries()
        COMMANDS[args.command](args)
    except (KeyboardInterrupt, Terminated, Exception) as exc:
        stopped = stop.exit_code() or (EXIT_SIGINT if isinstance(exc, KeyboardInterrupt) else None)
        if stopped is not None:
            return _stopped(stopped)
        if isinstance(exc, UserError):
            print(f"rbcompile: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if os.environ.get("RBCOMPILE_DEBUG"):  # an rbcompile bug: one line, or the traceback
            raise
        print(f"rbcompile: internal error: {type(exc).__name__}: {first_line(exc)} "
              "(set RBCOMPILE_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        stop.ended = True
        note_stop(None)
    return _stopped(stop.exit_code()) if stop.received is not None else EXIT_OK  # swallowed


def _stopped(code: int) -> int:
    print(f"rbcompile: {'interrupted' if code == EXIT_SIGINT else 'terminated'}", file=sys.stderr)
    return code


def entry() -> None:
    """The `rbcompile` command (console script, `python -m rbcompile`, `python -m rbcompile.frontend.cli`).

    Once the command has ended, SIGINT / SIGTERM are ignored until the process is gone: CPython
    puts the default handlers back in place of Python ones while it finalises, and a SIGTERM
    then (under the default handler, a kill: -15, not 0 or 143) would misreport a command whose
    output is in place. After SIGINT / SIGTERM the command has already cleaned up; it then
    leaves without interpreter finalisation, because CPython re-kills itself with SIGINT there
    (exit -2, not 130) when a library evaluated code that saw the KeyboardInterrupt."""
    stop = _Stop()
    stop.install()
    code = _run(None, stop)
    for signum in (signal.SIGINT, signal.SIGTERM):  # SIG_IGN is kept through finalisation
        signal.signal(signum, signal.SIG_IGN)
    if code in (EXIT_SIGINT, EXIT_SIGTERM):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
