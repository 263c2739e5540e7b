"""``torch.compile`` applied to a built model from outside, one transformer block at a time.

Each block's ``forward`` is replaced by its compiled form (torchtitan compiles per block too): the
modules, their parameters and names stay as they are, so checkpoints, FSDP (whose hooks on the block
run eagerly around the compiled forward), tensor- and expert-parallel DTensors and pipeline stages
(which hold the same block modules) see the model unchanged. Repeated blocks share one compiled
graph, so compile time does not grow with depth.

Inside an MoE block the dispatcher's ``apply`` (sort by expert, gather, grouped GEMMs, combine; under
expert parallelism the all-to-alls) runs eagerly between two compiled regions: its shapes follow
the routing, which changes every step (per-expert row counts, capacity drops, the all-to-all split
sizes read on the host), so compiled it would recompile or fall back step after step. Attention,
norms, residuals, the router and the aux losses are compiled.

``CompileWatch`` counts graphs compiled, recompilations and the seconds spent compiling (forward
and the lazily compiled backward), for the training loop's metrics and progress line.
"""

from __future__ import annotations

import time
from types import TracebackType

import torch
from torch import nn
from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler

from moekit.layer import MoE


def apply_compile(blocks: list[nn.Module]) -> None:
    """Compile each block's forward in place; MoE dispatch stays eager (see the module docstring)."""
    for block in blocks:
        for module in block.modules():
            if isinstance(module, MoE):
                module.dispatcher.apply = torch.compiler.disable(module.dispatcher.apply, recursive=True)
        block.forward = torch.compile(block.forward)


class CompileWatch:
    """While entered: graphs compiled, how many were recompilations of a frame already compiled,
    and the wall seconds spent compiling (dynamo, AOT autograd, inductor; backward graphs included)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.recompiles = 0
        self.seconds = 0.0
        self._started: float | None = None

    def _start(self, args: CallbackArgs) -> None:
        self._started = time.perf_counter()
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            self.graphs += 1
            # compile_id is "frame/attempt" (a "!" prefix under compiled autograd): attempt > 0 recompiles.
            self.recompiles += args.compile_id.rsplit("/", 1)[-1] != "0"

    def _end(self, args: CallbackArgs) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def record(self) -> dict[str, float | int]:
        return {"compile_s": round(self.seconds, 2), "compiled_graphs": self.graphs, "recompiles": self.recompiles}

    def __enter__(self) -> CompileWatch:
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)
