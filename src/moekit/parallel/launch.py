"""Start a training job's ranks through torch's elastic launcher (``torchrun``) from ``moekit train``."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from moekit.errors import OptionError

LAUNCH_FLAGS = ("--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-id", "--max-restarts")


@dataclass(frozen=True)
class Launch:
    nproc: int  # ranks on this machine
    nnodes: str  # machines, or MIN:MAX
    rdzv_endpoint: str | None  # HOST:PORT, needed with more than one machine
    rdzv_id: str
    max_restarts: int

    @property
    def multi_node(self) -> bool:
        return self.nnodes != "1"


def without_launch_flags(argv: list[str]) -> list[str]:
    """The ``train`` arguments each rank gets: the launcher's own flags taken out."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.split("=", 1)[0] in LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def launch_training(launch: Launch, train_argv: list[str], run_dir: Path) -> tuple[int, int] | None:
    """Run ``moekit train TRAIN_ARGV`` on every rank; every rank's output goes to RUN_DIR/logs and the
    console shows rank 0's. Returns None, or the first failed rank and its exit code; a Ctrl-C raises
    ``KeyboardInterrupt`` once the ranks have stopped (each saves a checkpoint at the end of its step)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if launch.multi_node and not launch.rdzv_endpoint:
        raise OptionError("nnodes", "needs {rdzv_endpoint}", launch.nnodes, rdzv_endpoint="HOST:PORT")
    rendezvous = (
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", launch.rdzv_endpoint, "--rdzv-id", launch.rdzv_id]
        if launch.multi_node
        else ["--standalone"]
    )
    launcher = ["--nproc-per-node", str(launch.nproc), "--nnodes", launch.nnodes]
    launcher += ["--max-restarts", str(launch.max_restarts)]
    launcher += ["--log-dir", str(run_dir / "logs"), "--tee", "3", "--local-ranks-filter", "0"]
    try:
        torchrun([*launcher, *rendezvous, "-m", "moekit", "train", *train_argv])
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        return rank, failure.exitcode
    except SignalException as err:
        # NOTE: the agent passes SIGINT on to the ranks and waits for them before raising this.
        if err.sigval != signal.SIGINT:
            raise
        raise KeyboardInterrupt from None
    return None
