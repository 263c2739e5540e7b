"""Inference matmuls on a CPU: which layout and kernel multiply 16-bit weights at the speed of their bytes.

Legend: M rows, K input dim, N output dim.

At batch 1 a decode step is a chain of matrix-vector products: its speed is the bytes of the weights
it reads. What torch 2.13 does with 16-bit weights on a CPU depends on their layout and on the CPU
(``python benchmarks/cpu_matmul.py`` prints the table on the machine at hand; these are its
``benchmarks/measured/cpu-matmul.json``: an AMD EPYC with AVX512-BF16, one thread, 1024 x 4096 weights
streamed from memory, ms per weight):

=========================  =============  ====================  ========================
bf16 weight                 1 row          2 rows                32 rows
=========================  =============  ====================  ========================
stored [K, N]               1.49           0.97                  1.42
stored [N, K], oneDNN       0.53           0.58                  1.02
stored [N, K], ATen GEMV    0.34           0.62                  9.98
prepacked for oneDNN        0.25           0.29                  0.78
=========================  =============  ====================  ========================

and on a CPU without native bf16 or fp16 (AVX2, and fp16 on that EPYC) a weight stored [K, N] takes
13-17 ms for one row: 40x its bytes. Hence the rules here (prepacking is ``prepack``'s):

- **Layout**: inference stores 16-bit expert weights output-major (``[E, N, K]`` storage seen as the
  ``[E, K, N]`` the code multiplies, nn.Linear's and Hugging Face's layout); fp32 keeps ``[K, N]``,
  where MKL's matrix-vector product is the faster one.
- **One row**: a forward of a single token runs with oneDNN off (``single_token_kernels``), so 16-bit
  products of weights not prepacked take ATen's reduced-precision GEMV (fp32 accumulation), 1.6x
  oneDNN's speed at one row.
- **Many rows without native support**: from ``UPCAST_MIN_ROWS`` rows, a 16-bit weight the CPU cannot
  multiply natively is converted to fp32 for the product (the result rounded back to 16 bits): a
  conversion pass is cheaper than the scalar fallback, which slows linearly in the rows (fp16 on
  the EPYC: 2.92 ms at 8 rows against 1.63 upcast, 1.21 against 1.32 at 4).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

from moekit.kernels import FEW_ROWS, rows_available, rows_bf16, rows_f32

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
UPCAST_MIN_ROWS = 6  # from 6 rows (the crossover lies between 4 and 8: cpu_matmul.py, fp16 rows)


def output_major(dtype: torch.dtype) -> bool:
    """Whether inference stores weights of ``dtype`` output-major (``[N, K]`` under a ``[K, N]`` view)."""
    return dtype in SIXTEEN_BIT


def inference_layout(w_EKN: Tensor, dtype: torch.dtype) -> Tensor:
    """``w`` in ``dtype``, laid out for inference: a new tensor (on the meta device, no storage), unless
    ``w`` is one already. Same shape; only the strides say output-major."""
    if w_EKN.dtype == dtype and _is_output_major(w_EKN) == output_major(dtype):
        return w_EKN
    if not output_major(dtype):
        return w_EKN.to(dtype, memory_format=torch.contiguous_format)
    out = torch.empty(w_EKN.mT.shape, dtype=dtype, device=w_EKN.device).mT
    return out if w_EKN.is_meta else out.copy_(w_EKN)


def _is_output_major(w: Tensor) -> bool:
    """The last two dims stored transposed: ``[..., N, K]`` memory under a ``[..., K, N]`` view."""
    return w.stride(-2) == 1 and (w.shape[-1] == 1 or w.stride(-1) == w.shape[-2])


@functools.cache
def native_16bit(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` natively (oneDNN's AVX512-BF16 / AMX / AVX512-FP16 kernels)."""
    if dtype in SIXTEEN_BIT and not torch.backends.mkldnn.is_available():  # a torch built without oneDNN
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def upcasts(x_MK: Tensor, w_KN: Tensor) -> bool:
    """Whether ``mm`` computes ``x @ w`` in fp32 (a 16-bit weight this CPU lacks kernels for, many rows)."""
    return (
        w_KN.device.type == "cpu"
        and w_KN.dtype in SIXTEEN_BIT
        and x_MK.shape[0] >= UPCAST_MIN_ROWS
        and not native_16bit(w_KN.dtype)
    )


def mm(x_MK: Tensor, w_KN: Tensor, out: Tensor | None = None) -> Tensor:
    """``x @ w`` (into ``out`` when given), upcast to fp32 where ``upcasts`` says so: by oneDNN's fp32
    kernel over the weight reordered on the way (``_onednn_linear``), 2.1x MKL's ``mm`` at 512 rows
    (1024 x 4096, 2 threads: 11.9 ms against 25.2, the fp16 -> fp32 conversion 0.2 of them)."""
    if not upcasts(x_MK, w_KN):
        return torch.mm(x_MK, w_KN, out=out)
    x32 = x_MK.float()
    y = _onednn_linear(x32, w_KN.t().float()) if torch.backends.mkldnn.is_available() else x32 @ w_KN.float()
    return y.to(x_MK.dtype) if out is None else out.copy_(y)


class _OneDNNSwitch:
    """oneDNN off while any thread is inside a one-token forward, back as it was when the last leaves.

    NOTE: the switch is process-wide in torch: a forward of many tokens on another thread meanwhile
    runs without oneDNN (slower, the same arithmetic but for rounding). Counted under a lock, so
    overlapping forwards cannot leave it off for good."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._saved = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        with self._lock:
            if self._inside == 0:
                self._saved = torch._C._get_mkldnn_enabled()
                torch._C._set_mkldnn_enabled(False)
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0:
                    torch._C._set_mkldnn_enabled(self._saved)


_ONEDNN = _OneDNNSwitch()


def single_token_kernels(tokens: int) -> contextlib.AbstractContextManager:
    """Around a forward of ``tokens`` tokens: for one token, oneDNN off (``_OneDNNSwitch``), so that its
    16-bit matrix-vector products take ATen's GEMV; a no-op for more."""
    if tokens != 1 or not torch.backends.mkldnn.is_available():
        return contextlib.nullcontext()
    return _ONEDNN.off()


def prepackable(w: Tensor) -> bool:
    """Whether ``prepack`` takes ``w``: fp32, or a 16-bit weight this CPU's oneDNN multiplies natively."""
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return w.dtype == torch.float32 or (w.dtype in SIXTEEN_BIT and native_16bit(w.dtype))


PREPACK_ROWS = 512  # the rows oneDNN picks the blocked layout for: best at every count of rows, see prepack


def prepack(w_NK: Tensor) -> Tensor:
    """``w`` ([out, in], nn.Linear's layout) reordered once into oneDNN's blocked layout for its kernel:
    an opaque tensor for ``packed_linear`` only. Never slower than the plain layout and up to 2.2x
    faster at one thread (``benchmarks/measured/cpu-matmul.json``, 1024 x 4096: bf16 0.25 ms against 0.34
    for ATen's GEMV at one row, 0.31 against 0.55 for oneDNN unpacked at 4 rows; fp32 0.60 against 0.67
    for MKL at one row, 0.92 against 1.34 at 4, 18.0 against 39.5 at 512).

    The layout is the one oneDNN picks for ``PREPACK_ROWS`` rows: for fp32 the one it picks for a single
    row is slower at every count of rows (``python benchmarks/cpu_matmul.py --threads 2 --rows 1 4 16
    512``, ``benchmarks/measured/cpu-matmul-2-threads.json``, ms, one-row layout / this one: 0.39 / 0.30
    at 1 row, 0.69 / 0.33 at 4, 0.95 / 0.55 at 16, 10.4 / 9.1 at 512; an earlier run on a busier
    machine: 0.49 / 0.48, 0.61 / 0.48, 0.76 / 0.62, 9.7 / 9.5); bf16 gets the same layout either way."""
    return torch.ops.mkldnn._reorder_linear_weight(w_NK.contiguous(), PREPACK_ROWS)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ w.t() + bias`` over a ``prepack``-ed weight, for any number of rows."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def unpacked_linear(x_MK: Tensor, w_NK: Tensor) -> Tensor:
    """``x @ w.t()`` by ``packed_linear``'s kernel over a weight not prepacked (``prepackable`` ones only),
    the same sums, bit for bit (tests/unit/test_infer_resident_experts.py). For weights that cannot stay
    packed: an offloaded expert's, whose slot is refilled. 16-bit weights: oneDNN's layout for them is
    the same at any count of rows (on this CPU, 1 to 1000 rows), so its own reorder for this call's rows
    is the one ``prepack`` made. fp32: reordered into ``prepack``'s layout on each call, which oneDNN's
    own reorder for one row would not give. Per 1024 x 4096 weight at one row, 2 threads
    (``cpu-matmul-2-threads.json``): bf16 0.43 against 0.16 ms prepacked, fp32 1.46 against 0.30."""
    return packed_linear(x_MK, prepack(w_NK)) if w_NK.dtype == torch.float32 else _onednn_linear(x_MK, w_NK)


# NOTE: rows below which the row kernel multiplies a plain bf16 weight on a CPU without native bf16
# (AVX2), where torch's alternative is ``mm``'s upcast (oneDNN's fp32 GEMM over the weight converted):
# per 1024 x 4096 weight, 2 threads, in one ad hoc run (interleaved, a Zen 3), the row kernel 2.64
# against 3.71 ms at 16 rows, 4.65 against 5.03 at 32, 6.40 against 5.99 at 48, 9.26 against 7.84 at 64;
# over the other d1024 shapes (1536 x 1024, 8192 x 1024, 1024 x 2048) the crossover also lies between 32
# and 48 rows.
ROWS_WITHOUT_NATIVE = 32


# NOTE: rows up to which the fp32 row kernel multiplies a plain fp32 weight (``plain_fp32``), per 1024 x 4096
# weight, 2 threads, a Zen 3, ad hoc, against oneDNN's prepacked kernel: 0.98 against 1.41 ms at 1 row,
# 1.21 against 1.75 at 4, 1.65 against 2.20 at 8, 2.51 against 2.67 at 16, 4.48 against 3.64 at 32.
F32_ROWS = 16


@functools.cache
def plain_fp32() -> bool:
    """Whether inference keeps fp32 weights plain for the fp32 row kernel (``kernels.rows_f32``) rather than
    prepacked for oneDNN: on a CPU whose best torch kernels are AVX2 (no AVX-512), where oneDNN's fp32
    kernel reads a weight for a few rows at about 12 GB/s and the row kernel at the memory's 17 (a Zen 3,
    2 threads, ad hoc); the kernels built."""
    cpu = torch.backends.cpu.get_cpu_capability() == "AVX2"
    return cpu and rows_available() and torch.backends.mkldnn.is_available()


def plain_linear(x_MK: Tensor, w_NK: Tensor) -> Tensor:
    """``x @ w.t()`` for a weight kept in its plain ``[N, K]`` layout (``infer.resident_experts``' row
    layout). bf16 (a batch-1 decode's): up to ``kernels.FEW_ROWS`` rows by the row kernel, which reads it
    faster than oneDNN reads its prepacked copy; more (a prompt) by ``unpacked_linear`` on a CPU with
    native bf16 kernels. Without them (AVX2) the row kernel takes fewer than ``ROWS_WITHOUT_NATIVE`` rows,
    and ``mm`` the rest, in fp32. fp32 (``plain_fp32``): up to ``F32_ROWS`` rows by the fp32 row kernel,
    more by oneDNN over the weight reordered for the call (``_onednn_linear``: 0.84-1.04x the prepacked
    weight's speed from 17 to 512 rows over d1024's shapes, ad hoc); rows that record a graph (a decoded
    rollout scored for learning) by ``mm``, which autograd follows."""
    rows = x_MK.shape[0]
    if w_NK.dtype == torch.float32:
        if torch.is_grad_enabled() and x_MK.requires_grad:
            return torch.mm(x_MK, w_NK.t())
        return rows_f32(x_MK, w_NK) if rows <= F32_ROWS else _onednn_linear(x_MK, w_NK)
    native = native_16bit(w_NK.dtype)
    if rows <= FEW_ROWS or (rows < ROWS_WITHOUT_NATIVE and not native):
        return rows_bf16(x_MK, w_NK)
    return unpacked_linear(x_MK, w_NK) if native else mm(x_MK, w_NK.t())


def _onednn_linear(x_MK: Tensor, w_NK: Tensor) -> Tensor:
    """``x @ w.t()`` by oneDNN, the weight reordered for this call's rows."""
    # NOTE: row-major [N, K]: over a transposed view, oneDNN's one-row kernel sums in another order.
    return torch.ops.mkldnn._linear_pointwise(x_MK, w_NK.contiguous(), None, "none", [], "")
