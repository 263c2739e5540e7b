"""Files that readers see complete or not at all: write to a temporary name, fsync, rename."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO


def fsync_file(path: Path) -> None:
    """Flush a file written by someone else (torch.save, safetensors) to disk."""
    fd = os.open(path, os.O_RDONLY)
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


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, lambda f: f.write(data))
