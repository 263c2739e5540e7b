"""Files and directories that readers see complete or not at all: write to a temporary name, fsync,
rename, fsync the directory (a rename is only durable once its directory is on disk)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

RENAME_EXCHANGE = 2  # renameat2(2) flag: swap two names in one step (Linux >= 3.15)
AT_FDCWD = -100


def fsync_file(path: Path) -> None:
    """Flush a file written by someone else (torch.save, safetensors) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (the names created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write through a temp file in the same directory, then rename: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")  # unique per writer
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, lambda f: f.write(data))


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file ({} when there is none); ValueError naming the file if it cannot be read."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def write_json_atomic(path: Path, obj: Any) -> None:
    """``obj`` as indented UTF-8 JSON (non-ASCII characters kept as they are), written atomically."""
    write_bytes_atomic(path, (json.dumps(obj, ensure_ascii=False, indent=1) + "\n").encode("utf-8"))


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically; False where the system or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    done = renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # old kernel, or a filesystem without it (NFS)
        return False
    raise OSError(code, os.strerror(code), str(a))


def replace_dir(src: Path, dst: Path) -> None:
    """Rename directory ``src`` to ``dst``, replacing a ``dst`` that exists, then fsync the parent.

    ``dst`` names a complete directory at every moment: an existing one is swapped with ``src`` in one
    ``renameat2(RENAME_EXCHANGE)`` and then removed under its new (temporary) name. Where the
    filesystem cannot swap, the old ``dst`` is renamed aside first, leaving a moment without it.
    """
    src, dst = Path(src), Path(dst)
    if not dst.exists():
        os.replace(src, dst)  # an empty or missing dst: one rename
    elif _exchange(src, dst):
        shutil.rmtree(src)  # the old dst, now under src's name
    else:
        aside = dst.with_name(f".old-{dst.name}-{uuid.uuid4().hex[:8]}")
        os.replace(dst, aside)
        os.replace(src, dst)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(dst.parent)
