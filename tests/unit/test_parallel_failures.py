"""moekit.parallel.failures.collective_errors: which failures become a rank failure (a real gloo group)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moekit.parallel.failures import RankFailure, collective_errors
from moekit.run.layout import CheckpointError


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_backend_error_becomes_a_rank_failure(one_rank_group) -> None:
    failure = r"^rank 0: a collective failed.*parallel.timeout_s=7s \(\[gloo\] Connection"
    with pytest.raises(RankFailure, match=failure), collective_errors(7):
        raise RuntimeError("[gloo] Connection closed by peer")


def test_moekits_own_errors_keep_their_message(one_rank_group) -> None:
    # A checkpoint error quoting an OS error is not another rank's death.
    with pytest.raises(CheckpointError, match="Connection refused"), collective_errors(7):
        raise CheckpointError("/mnt/ckpt/step_000004: could not save ([Errno 111] Connection refused)")
