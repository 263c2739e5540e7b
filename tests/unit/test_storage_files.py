"""The file under every slow tier: bytes moved by ``StorageFile`` equal what plain Python file I/O reads
and writes (direct and buffered, aligned or not, at the end of the file), and a claimed file is one
process's alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moekit.storage.aligned import DIRECT_ALIGN, aligned_empty
from moekit.storage.files import FileInUse, StorageFile

CLAIM = """
import sys
from moekit.storage.files import FileInUse, StorageFile
try:
    StorageFile.claim(sys.argv[1]).remove()
except FileInUse as err:
    print("in use:", err)
    sys.exit(3)
"""


def _claim_in_another_process(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLAIM, str(path)], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # two more processes
def test_a_claimed_file_is_one_process_s_until_it_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "made" / "deeper" / "state.bin"
    file = StorageFile.claim(path)
    try:
        assert path.is_file()
        other = _claim_in_another_process(path)
        assert other.returncode == 3 and "in use by another process" in other.stdout, other.stderr
        with pytest.raises(FileInUse):  # a second claim in this process too: the lock is per open file
            StorageFile.claim(path)
    finally:
        file.remove()
    assert not (tmp_path / "made").exists(), "the directories the claim made go with the file"
    assert _claim_in_another_process(path).returncode == 0, "free again once removed"


def test_a_claim_that_fails_leaves_no_directory_behind(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        StorageFile.claim(tmp_path / "a-file" / "state.bin")
    kept = tmp_path / "kept"
    kept.mkdir()
    file = StorageFile.claim(kept / "new" / "state.bin")
    file.remove()
    assert kept.is_dir() and not any(kept.iterdir()), "a directory that was there stays; the one made goes"


def test_allocate_takes_the_room_up_front_and_zeroes_it(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    path.write_bytes(b"stale bytes of a run that died")
    file = StorageFile.claim(path)
    try:
        file.allocate(5 * DIRECT_ALIGN)
        assert path.stat().st_size == 5 * DIRECT_ALIGN
        assert path.stat().st_blocks * 512 >= 5 * DIRECT_ALIGN, "the blocks are the file's before any write"
        assert path.read_bytes() == bytes(5 * DIRECT_ALIGN)
    finally:
        file.remove()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_transfers_move_the_bytes_plain_file_io_sees(tmp_path: Path, direct: bool) -> None:
    """Aligned buffers and ranges (direct where the filesystem allows) and unaligned ones (buffered),
    written and read back, against Python's own ``open``; a read past the end stops there."""
    size = 6 * DIRECT_ALIGN + 100  # the file ends off the 4 KiB grid
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(data.tolist()))
    with StorageFile.open(path, direct=direct) as file:
        assert direct or not file.direct
        buf = aligned_empty(2 * DIRECT_ALIGN)
        assert file.read(buf, DIRECT_ALIGN) == 2 * DIRECT_ALIGN
        assert torch.equal(buf, data[DIRECT_ALIGN : 3 * DIRECT_ALIGN])
        odd = torch.empty(777, dtype=torch.uint8)
        assert file.read(odd, 1234) == 777 and torch.equal(odd, data[1234 : 1234 + 777])
        tail = aligned_empty(2 * DIRECT_ALIGN)
        assert file.read(tail, 5 * DIRECT_ALIGN) == DIRECT_ALIGN + 100, "short where the file ends"
        assert torch.equal(tail[: DIRECT_ALIGN + 100], data[5 * DIRECT_ALIGN :])

    claimed = StorageFile.claim(tmp_path / "out.bin")
    try:
        claimed.allocate(4 * DIRECT_ALIGN)
        block = aligned_empty(DIRECT_ALIGN).copy_(data[:DIRECT_ALIGN])
        assert claimed.write(block, 2 * DIRECT_ALIGN) == DIRECT_ALIGN
        assert claimed.write(data[100:400].clone(), 10) == 300
        written = (tmp_path / "out.bin").read_bytes()
        assert written[2 * DIRECT_ALIGN : 3 * DIRECT_ALIGN] == bytes(data[:DIRECT_ALIGN].tolist())
        assert written[10:310] == bytes(data[100:400].tolist()) and written[:10] == bytes(10)
    finally:
        claimed.remove()
