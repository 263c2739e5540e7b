"""The file under every slow tier: one descriptor for buffered and one for direct I/O, and the one loop
every read and write of offloaded bytes goes through.

A transfer is direct (``O_DIRECT``: the disk moves the bytes by DMA, no copy through the OS page
cache and no cached pages beside a memory budget) when the file has a direct descriptor and the
buffer's address, the file offset and the length are all whole 4 KiB blocks; otherwise it goes
through the page cache (``preadv`` / ``pwritev``), and with ``drop_pages`` the pages it touched are
evicted right after (so the page cache cannot act as a hidden fast tier).

A file that a process writes (offloaded training's state) is ``claim``-ed: created with the
directories missing above it, locked for this process alone (``flock``: a second process claiming it
fails at once, and a process that dies lets it go), and given all its room up front (``allocate``),
so a full disk shows at the start, not in the middle of a run; ``remove`` takes away the file and
the directories its claim made.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from torch import Tensor

from moekit.storage.aligned import DIRECT_ALIGN, open_direct

PAGE = os.sysconf("SC_PAGE_SIZE")  # the page cache evicts whole pages


class FileInUse(OSError):
    """Another process holds the claim on a file."""


def transfer(fd: int, view: memoryview, offset: int, write: bool) -> int:
    """Move ``view`` to (``write``) or from the file at ``offset``; the bytes moved. A write goes on call
    after call until all is written (a short write: a signal, or the disk filling, which the next call
    reports); a read stops short only where the file ends (a regular file reads short nowhere else, and
    a direct read continued there would start off its 4 KiB grid)."""
    io = os.pwritev if write else os.preadv
    done = 0
    while done < len(view):
        moved = io(fd, [view[done:]], offset + done)
        done += max(moved, 0)
        if moved <= 0 or not write:
            break
    return done


class StorageFile:
    """A file moved to and from CPU buffers by byte range, directly where it can be."""

    def __init__(self, path: Path, fd: int, direct: bool, drop_pages: bool) -> None:
        self.path, self.drop_pages = Path(path), drop_pages
        self._fd = fd
        self._direct_fd = -1
        self._claimed = False  # created and locked by this process: removed by ``remove``
        self._made: list[Path] = []  # directories made for a claimed file, deepest first
        if direct:
            self._open_direct()

    @classmethod
    def open(cls, path: Path, direct: bool = True, drop_pages: bool = False) -> StorageFile:
        """An existing file, for reading."""
        return cls(path, os.open(path, os.O_RDONLY), direct, drop_pages)

    @classmethod
    def claim(cls, path: Path) -> StorageFile:
        """``path`` created (or taken over from a process that is gone) and locked for this process alone;
        empty until ``allocate``; the directories missing above it made. ``FileInUse`` when another process
        holds it; any ``OSError`` leaves nothing made behind."""
        path = Path(path)
        made = _make_dirs(path.parent)
        try:
            fd = _lock(path)
        except BaseException:
            _remove_dirs(made)
            raise
        file = cls(path, fd, direct=False, drop_pages=False)
        file._claimed, file._made = True, made
        return file

    def allocate(self, size: int) -> None:
        """Empty the claimed file and give it ``size`` bytes of zeros, its room on disk taken now (an
        ``OSError`` such as ``ENOSPC`` if the disk lacks it); then open it for direct I/O as well."""
        assert self._claimed
        os.ftruncate(self._fd, 0)
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise OSError(err.errno, f"{err.strerror} (needs {size} bytes)", str(self.path)) from None
            os.ftruncate(self._fd, size)  # a filesystem without preallocation: room taken as written
        self._open_direct()

    def _open_direct(self) -> None:
        # NOTE: through /proc/self/fd: the same file as ``_fd``, even if its name now points elsewhere.
        source = Path(f"/proc/self/fd/{self._fd}")
        flags = os.O_RDWR if self._claimed else os.O_RDONLY
        self._direct_fd = open_direct(source if source.exists() else self.path, flags)

    @property
    def direct(self) -> bool:
        """Whether direct transfers are possible (the filesystem allows them)."""
        return self._direct_fd >= 0

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read(self, buf_U8: Tensor, offset: int) -> int:
        """Bytes from ``offset`` into ``buf_U8`` (a contiguous CPU uint8 tensor); how many (fewer at the end)."""
        return self._transfer(buf_U8, offset, write=False)

    def write(self, buf_U8: Tensor, offset: int) -> int:
        """``buf_U8`` into the file at ``offset``; how many bytes."""
        return self._transfer(buf_U8, offset, write=True)

    def _transfer(self, buf_U8: Tensor, offset: int, write: bool) -> int:
        nbytes = buf_U8.numel()
        aligned = buf_U8.data_ptr() % DIRECT_ALIGN == 0 and offset % DIRECT_ALIGN == 0 and nbytes % DIRECT_ALIGN == 0
        fd = self._direct_fd if aligned and self.direct else self._fd
        done = transfer(fd, memoryview(buf_U8.numpy()), offset, write)
        if fd == self._fd and self.drop_pages:
            self.evict(offset, nbytes)
        return done

    def evict(self, offset: int = 0, nbytes: int = 0) -> None:
        """Evict a byte range (all of the file: 0, 0) from the page cache, widened to whole pages: the
        kernel drops only the pages wholly inside the range, so a range's first and last would stay."""
        if nbytes:
            start, end = offset - offset % PAGE, -(-(offset + nbytes) // PAGE) * PAGE
            offset, nbytes = start, end - start
        os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close the descriptors (a claim is let go)."""
        for fd in (self._direct_fd, self._fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._direct_fd = -1

    def remove(self) -> None:
        """Remove a claimed file, while its claim is held (no other process can have taken it), then close."""
        if self._claimed and self._fd >= 0:
            self.path.unlink(missing_ok=True)
        self.close()
        _remove_dirs(self._made)
        self._made = []

    def __enter__(self) -> StorageFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lock(path: Path) -> int:
    """A descriptor of ``path`` (created if missing) holding its exclusive lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FileInUse(errno.EBUSY, "in use by another process", str(path)) from None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # its holder removed it as this process opened it: claim the one there now


def _make_dirs(directory: Path) -> list[Path]:
    """Make ``directory`` and the missing ones above it; those this call made, deepest first."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    made = []
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:  # made meanwhile by another process (another rank), or not a directory
                continue
            made.insert(0, path)
    except BaseException:
        _remove_dirs(made)
        raise
    return made


def _remove_dirs(made: list[Path]) -> None:
    """Remove the directories a claim made, deepest first, where they are empty (another rank's file
    may still be in one)."""
    for path in made:
        try:
            path.rmdir()
        except OSError:
            return


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
