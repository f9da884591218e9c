"""Writes that never destroy an earlier file.

Every file blocklab writes (checkpoints, reports, figures, JSON) goes through
`atomic_path` or `atomic_write`: the new content is written to a temporary
file in the destination's own directory, flushed and `fsync`ed, then renamed
over the destination with `os.replace`, which is atomic on POSIX and Windows
within one filesystem. A failure at any point (a full disk, an unserialisable
value, an interrupt) leaves the old file exactly as it was and removes the
temporary one.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ._validate import ConfigError

__all__ = [
    "atomic_dir",
    "atomic_path",
    "atomic_write",
    "check_folder_target",
    "check_writable",
]


@contextlib.contextmanager
def atomic_path(path: str | Path, *, owner: str = "write") -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`.

    Use it for writers that want a file name (``fig.savefig(tmp)``,
    ``np.save(tmp, ...)``). The temporary file keeps `path`'s suffix, so
    format detection by extension still works. Parent folders are created.

    As editors do: a symlink is written through (its resolved target is
    replaced, the link stays a link); an existing file keeps its permission
    bits (a new one gets those of a plain `open()`); a folder that cannot be
    written raises an `OSError` naming that folder, not the temporary file.
    """
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.is_dir():
        raise ConfigError(f"{owner}: {path} is a directory, expected a file path.")
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent
        )
    except OSError as err:
        raise _folder_error(owner, path, err) from err
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # mkstemp creates 0600: give the file the old file's mode, or the
        # mode a plain open() would.
        os.chmod(tmp, mode)
        try:
            os.replace(tmp, path)
        except OSError as err:
            raise _folder_error(owner, path, err) from err
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(
    path: str | Path, *, owner: str = "write", overwrite: bool = False
) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success it becomes `path`.

    The folder's files are `fsync`ed, then the folder is renamed to `path`.
    An existing `path` must be an empty folder unless `overwrite`; it is
    renamed aside first and removed only after the new folder is in place
    (put back if the rename fails). On any failure the temporary folder is
    removed and `path` is left as it was.

    The rule of `atomic_path`: a symlink is written through (the folder it
    resolves to is replaced, the link stays a link); an existing folder keeps
    its permission bits (a new one gets those of a plain `mkdir`); a folder
    that cannot be written raises an `OSError` naming `path` and its folder,
    not the temporary folder.
    """
    import shutil

    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    check_folder_target(path, owner=owner, overwrite=overwrite)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o777 & ~_umask()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(
            tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        )
    except OSError as err:
        raise _folder_error(owner, path, err) from err
    try:
        yield tmp
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        _fsync_dir(tmp)
        old = None
        try:
            if path.exists():
                old = Path(
                    tempfile.mkdtemp(
                        prefix=f".{path.name}.", suffix=".old", dir=path.parent
                    )
                )
                os.replace(path, old / "x")
            try:
                os.replace(tmp, path)
            except BaseException:
                if old is not None:
                    os.replace(old / "x", path)
                raise
        except OSError as err:
            if old is not None:  # empty unless the old folder could not go back
                with contextlib.suppress(OSError):
                    os.rmdir(old)
            raise _folder_error(owner, path, err) from err
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)


def atomic_write(path: str | Path, data: bytes | str, *, owner: str = "write") -> Path:
    """Write `data` (bytes, or text as UTF-8) to `path` atomically; returns the path."""
    blob = data.encode() if isinstance(data, str) else bytes(data)
    with atomic_path(path, owner=owner) as tmp:
        tmp.write_bytes(blob)
    return Path(path)


def check_folder_target(path: str | Path, *, owner: str, overwrite: bool) -> None:
    """Raise a `ConfigError` unless `path` can become a folder: it is absent,
    an empty folder, or a folder and `overwrite` is set."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{owner}: {path} exists and is not a folder.")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ConfigError(
            f"{owner}: the folder {path} exists and is not empty; pass "
            "overwrite=True to replace it."
        )


def check_writable(path: str | Path, *, owner: str, name: str) -> Path:
    """Fail now, not after hours of work, if `path` cannot be written later.

    Checks that `path` is not a directory and that its nearest existing
    ancestor is a writable directory (folders that do not exist yet will be
    created). Raises `ConfigError` naming the argument.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{owner}: {name}={str(path)!r} is a directory, not a file.")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{owner}: {name}={str(path)!r} cannot be written ({parent} is not a "
            "writable folder)."
        )
    return path


def _folder_error(owner: str, path: Path, err: OSError) -> OSError:
    """`err` (same type and errno) naming the destination and its folder."""
    return type(err)(
        err.errno,
        f"{owner}: cannot write {path.name!r} into the folder {str(path.parent)!r} "
        f"({err.strerror or err}); choose a writable folder",
        str(path.parent),
    )


def _umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    """Persist the rename itself (best effort: not every platform allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
