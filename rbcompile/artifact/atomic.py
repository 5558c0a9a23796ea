"""Write an output file or folder atomically: into a temporary sibling, then rename it.

A folder is replaced only when it is one of ours: its marker file says which files it holds
(`owned(folder)`), and the folder holds nothing else; a folder of the user's is never touched.
The check and the swap run under an exclusive lock on the parent folder (two writers of one
output queue up), the old folder is moved aside and put back if the swap fails, and SIGINT /
SIGTERM are held off while the swap and the clean-up run, so no temporary or `.old` folder
survives an exit path Python sees.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Callable, TypeVar

from rbcompile.errors import UserError

T = TypeVar("T")
Owned = Callable[[Path], "set[str] | None"]  # files a folder's marker lists, or None: not ours
_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class _Held:
    """The signals one `signals_held` block has caught, and whether to drop them."""

    def __init__(self):
        self.received: list[int] = []
        self.dropped = False

    def __call__(self, signum, frame):
        self.received.append(signum)


_blocks: list[_Held] = []  # the open `signals_held` blocks of the main thread, innermost last


@contextlib.contextmanager
def signals_held():
    """Delay SIGINT / SIGTERM until the block ends (they are delivered then, unless
    `commit_output` dropped them). They are masked in this thread and, in the main
    thread, caught by a recording handler: a signal sent to the process can be taken by any
    thread that does not mask it, and CPython then runs the handler in the main thread."""
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    held, handlers = _Held(), {}
    if threading.current_thread() is threading.main_thread():
        handlers = {signum: signal.signal(signum, held) for signum in _SIGNALS}
        _blocks.append(held)
    try:
        yield
    finally:
        if held.dropped:
            _drain_masked()
        if handlers:
            _blocks.pop()
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        for signum in () if held.dropped else dict.fromkeys(held.received):
            signal.raise_signal(signum)


def _drain_masked() -> None:
    while signal.sigtimedwait(_SIGNALS, 0) is not None:
        pass


_commits = 0  # outputs put in place by this process (see `commits`)
_stop: BaseException | None = None  # the stop a command's signal handler raised (`note_stop`)


def note_stop(stop: BaseException | None) -> None:
    """A command's signal handler notes the exception it raises to stop the command (None: the
    command has ended). Should code swallow it (a library catching what a C++ binding made of a
    KeyboardInterrupt, and going on), `write_file` / `write_folder` raise it again instead of
    putting the output in place: a stopped command keeps its promise of the old output."""
    global _stop
    _stop = stop


def _raise_noted_stop() -> None:
    if _stop is not None:
        raise _stop


def commits() -> int:
    """How many outputs this process has put in place. A command's signal handler compares it
    with the count when the command began: once its output is committed, a signal no longer
    stops the command (it would report "stopped" with the new output in place)."""
    return _commits


def commit_output() -> None:
    """The output is in place: count it, and drop the SIGINT / SIGTERM held by the innermost
    `signals_held` block until it ends (the work they would stop is complete; the command
    ends as it would have without them)."""
    global _commits
    _commits += 1
    _drain_masked()
    if _blocks:
        _blocks[-1].dropped = True


@contextlib.contextmanager
def locked(folder: Path):
    """An exclusive advisory lock on `folder` (a directory file descriptor: nothing written)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def check_replaceable(out_dir: Path, owned: Owned, kind: str) -> None:
    """UserError unless `out_dir` can be written: absent, an empty folder, or an earlier `kind`
    holding only the files its marker lists; and its parent is (or can be made) writable."""
    out_dir = Path(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir() or out_dir.is_symlink():
            raise UserError(f"{out_dir} exists and is not a folder; refusing to replace it")
        present = {p.name for p in out_dir.iterdir()}
        listed = owned(out_dir) if present else set()
        if listed is None:
            raise UserError(f"{out_dir} exists and is not {kind}; refusing to replace it")
        extra = sorted(present - listed)
        if extra:
            raise UserError(f"{out_dir} holds files that are not part of {kind} ({extra[0]}"
                            f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}); "
                            "refusing to replace it")
    parent = out_dir.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot write {out_dir}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {out_dir}: {parent} is not writable")


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_file(path, write: Callable[[Path], T]) -> T:
    """Call `write(tmp)` on a temporary file next to `path`, then rename it to `path`; returns
    what `write` returned. A failure leaves no temporary file and the old `path` untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        result = write(tmp)
        with signals_held():
            _raise_noted_stop()
            tmp.chmod(0o666 & ~_umask())
            os.replace(tmp, path)
            commit_output()
    except BaseException:
        with signals_held():
            tmp.unlink(missing_ok=True)
        raise
    return result


def write_folder(out_dir, write: Callable[[Path], T], owned: Owned, kind: str) -> T:
    """Call `write(tmp)` on a fresh temporary folder next to `out_dir`, then swap it in for
    `out_dir`; returns what `write` returned. An existing `out_dir` is replaced only if
    `check_replaceable` allows it; any failure or signal leaves the old `out_dir` as it was
    and no temporary folder."""
    out_dir = Path(out_dir)
    check_replaceable(out_dir, owned, kind)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out_dir.parent}: {exc.strerror}") from None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as exc:
        raise UserError(f"cannot write in {out_dir.parent}: {exc.strerror}") from None
    umask = _umask()
    try:
        result = write(tmp)
        for file in tmp.iterdir():
            file.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        with signals_held(), locked(out_dir.parent):
            _raise_noted_stop()
            check_replaceable(out_dir, owned, kind)  # again: another writer may have been here
            _swap(tmp, out_dir)
            commit_output()  # the new folder is in place: "stopped" would now be false
    except BaseException:
        with signals_held():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _swap(new: Path, out_dir: Path) -> None:
    """Rename `new` to `out_dir`; an existing `out_dir` is moved aside first and put back if
    the rename fails."""
    if not out_dir.exists():
        os.replace(new, out_dir)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
    try:
        os.replace(out_dir, aside / "previous")
        try:
            os.replace(new, out_dir)
        except BaseException:
            os.replace(aside / "previous", out_dir)
            raise
    except OSError as exc:
        raise UserError(f"cannot replace {out_dir}: {exc.strerror}") from None
    finally:
        shutil.rmtree(aside, ignore_errors=True)
