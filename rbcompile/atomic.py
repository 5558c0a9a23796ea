"""Write an output file or folder atomically: into a temporary sibling, then rename it."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

from .errors import UserError

T = TypeVar("T")


def check_replaceable(out_dir: Path, marker: str, kind: str) -> None:
    """UserError unless `out_dir` is absent or an earlier `kind` (it holds `marker`)."""
    if out_dir.exists() and not (out_dir / marker).is_file():
        raise UserError(f"{out_dir} exists and is not {kind}; refusing to replace it")


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
        tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return result


def write_folder(out_dir, write: Callable[[Path], T], marker: str, kind: str) -> T:
    """Call `write(tmp)` on a fresh temporary folder next to `out_dir`, then rename it to
    `out_dir`; returns what `write` returned. An existing `out_dir` is replaced only if it holds
    `marker` (it is an earlier `kind`); a failure leaves no temporary folder and the old
    `out_dir` untouched."""
    out_dir = Path(out_dir)
    check_replaceable(out_dir, marker, kind)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    umask = _umask()
    try:
        result = write(tmp)
        for file in tmp.iterdir():
            file.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.replace(out_dir, old / "previous")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
