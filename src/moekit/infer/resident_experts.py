"""A resident model's weights in the forms inference multiplies fastest on a CPU, swapped in at load.

- ``QuantizedExperts``: ``moekit generate RUN --expert-format int8|int4`` without ``--memory-budget``.
  Every expert stays in memory, a quarter (int8) or about an eighth (int4) of its bf16 bytes, so a
  memory-bound decode step reads that much less; the formats and kernels are ``infer.quant``'s.
- ``QuantizedLinear``: ``--dense-format int8|int4``, the weights outside the routed experts (attention's
  projections, dense and shared FFNs, the output head) in the same formats, as llama.cpp's Q8_0 and
  Q4_K_M files hold every matrix: a batch-1 step reads each of them once, like the picked experts.
- ``PackedExperts`` and ``PackedLinear``: fp32 weights, and 16-bit ones on a CPU with native 16-bit
  kernels, reordered once into oneDNN's blocked layout (``experts.matmul.prepack``), which it reads
  up to 2.2x faster.
- ``RowExperts`` and ``RowLinear``: for a batch-1 decode (``prepack_``'s ``few_rows``), and for every
  load on a CPU without native bf16, bf16 weights kept in their plain layout, where ``moekit.kernels``'
  row kernel reads them faster still (fp32 ones too on a CPU without AVX-512); and ``RowRMSNorm``, its
  RMSNorm in one C call.

Each expert's rows are computed as the resident and offloaded paths compute them (``ExpertCompute``),
only the two matmuls differ. None of these is for training or saving: they hold no parameters.

Legend: R rows sorted by expert, D model dim, E experts, K input dim, N output dim.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from moekit.errors import OptionError
from moekit.experts import DenseFFN
from moekit.experts.grouped import ExpertCompute, GroupedExperts
from moekit.experts.matmul import (
    SIXTEEN_BIT,
    mm,
    native_16bit,
    packed_linear,
    plain_fp32,
    plain_linear,
    prepack,
    prepackable,
)
from moekit.infer.offloader import OffloadedExperts
from moekit.infer.quant import INT4_GROUP, QUANT_FORMATS, int4_mm, int8_mm, pack_int4_for_cpu, quantize_int8
from moekit.kernels import rms_norm_bf16, rows_available
from moekit.layer import MoE
from moekit.model.transformer import Attention

Kernel = Callable[[Tensor], Tensor]  # rows [M, K] -> [M, N]: the product with one weight (an expert's, a linear's)


class PerExpert(nn.Module):
    """Rows grouped by expert, each expert's computed with its own two products (``kernels``)."""

    def __init__(self, experts: GroupedExperts) -> None:
        super().__init__()
        # NOTE: weights and biases are (non-persistent) buffers so that model_bytes counts them.
        for role in ("w_in_bias", "w_out_bias"):
            bias = getattr(experts, role)
            self.register_buffer(role, None if bias is None else bias.detach(), persistent=False)
        self.compute = ExpertCompute(experts.activation, self.w_in_bias, self.w_out_bias)
        self.num_experts = experts.num_experts

    def kernels(self, e: int) -> tuple[Kernel, Kernel]:
        """Expert ``e``'s two products: with ``w_in``, with ``w_out``."""
        raise NotImplementedError

    def forward(self, x_RD: Tensor, tokens_per_expert: Tensor | None = None, *, schedule=None) -> Tensor:
        """Rows grouped by expert in order -> outputs, one expert at a time."""
        if schedule is not None or tokens_per_expert is None:
            raise ValueError(f"{type(self).__name__} computes one step's rows at once (no dispatch schedule)")
        y_RD = torch.empty_like(x_RD)
        start = 0
        for e, n in enumerate(tokens_per_expert.tolist()):
            if n:
                y_RD[start : start + n] = self.compute(x_RD[start : start + n], *self.kernels(e), e)
            start += n
        return y_RD


class QuantizedExperts(PerExpert):
    """The experts of one ``GroupedExperts``, quantized (``int8`` per output channel, ``int4`` in groups
    of 32); biases, when the experts have them, stay in full precision."""

    def __init__(self, experts: GroupedExperts, fmt: str) -> None:
        super().__init__(experts)
        if fmt not in QUANT_FORMATS:
            raise OptionError("expert_format", f"choose from {', '.join(QUANT_FORMATS)}", fmt)
        self.fmt = fmt
        for role in ("w_in", "w_out"):
            parts = [_quantized(w_KN, fmt) for w_KN in getattr(experts, role).detach()]
            self.register_buffer(f"{role}_q", torch.stack([q for q, _ in parts]))  # [E, N, K] int8 | torch's int4
            self.register_buffer(f"{role}_scale", torch.stack([s for _, s in parts]))  # [E, N] | [E, K/G, N, 2]

    def kernels(self, e: int) -> tuple[Kernel, Kernel]:
        weights = ((getattr(self, f"{r}_q")[e], getattr(self, f"{r}_scale")[e]) for r in ("w_in", "w_out"))
        return tuple(partial(_product, self.fmt, q=q, scale=scale) for q, scale in weights)


def _quantized(w_KN: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """A weight in ``fmt`` for ``_product``: int8 q [N, K] and scale [N], or torch's int4 packing."""
    return quantize_int8(w_KN) if fmt == "int8" else pack_int4_for_cpu(w_KN)


def _product(fmt: str, x_MK: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """``x @ w`` for a weight ``_quantized`` in ``fmt``, by torch's weight-only kernels."""
    return int8_mm(x_MK, q, scale) if fmt == "int8" else int4_mm(x_MK, q, scale)


class PackedExperts(PerExpert):
    """The experts of one ``GroupedExperts``, each weight ``prepack``-ed."""

    def __init__(self, experts: GroupedExperts) -> None:
        super().__init__(experts)
        # NOTE: opaque oneDNN tensors, one per expert and role (torch cannot stack them).
        for role in ("w_in", "w_out"):
            for e, w_KN in enumerate(getattr(experts, role).detach()):
                self.register_buffer(f"{role}_packed_{e}", prepack(w_KN.t()), persistent=False)

    def kernels(self, e: int) -> tuple[Kernel, Kernel]:
        return tuple(partial(packed_linear, packed=getattr(self, f"{r}_packed_{e}")) for r in ("w_in", "w_out"))


class RowExperts(PerExpert):
    """The bf16 (or fp32, ``experts.matmul.plain_fp32``) experts of one ``GroupedExperts`` kept in their plain
    output-major layout (``[E, N, K]`` storage: no copy where inference loaded bf16 ones so, as it does; a
    copy of fp32 ones, loaded ``[E, K, N]``), multiplied by ``plain_linear``: a few rows by a row kernel."""

    def __init__(self, experts: GroupedExperts) -> None:
        super().__init__(experts)
        for role in ("w_in", "w_out"):
            self.register_buffer(role, getattr(experts, role).detach().mT.contiguous(), persistent=False)  # [E, N, K]

    def kernels(self, e: int) -> tuple[Kernel, Kernel]:
        return partial(plain_linear, w_NK=self.w_in[e]), partial(plain_linear, w_NK=self.w_out[e])


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is quantized (``infer.quant``'s formats and kernels); its bias, when
    it has one, stays in full precision."""

    def __init__(self, linear: nn.Linear, fmt: str) -> None:
        super().__init__()
        q, scale = _quantized(linear.weight.detach().t(), fmt)
        self.fmt = fmt
        self.register_buffer("q", q, persistent=False)  # [N, K] int8 | torch's int4 packing
        self.register_buffer("scale", scale, persistent=False)  # [N] | [K/G, N, 2]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return _linear_rows(x, lambda rows: _product(self.fmt, rows, self.q, self.scale), self.bias)


class _PlainLinear(nn.Module):
    """An ``nn.Linear`` whose weight stays as it is, multiplied by the subclass's ``product``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().contiguous(), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def product(self, rows_MK: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return _linear_rows(x, self.product, self.bias)


class UpcastLinear(_PlainLinear):
    """An ``nn.Linear`` of a 16-bit weight this CPU has no native kernels for, computed by
    ``experts.matmul.mm``: many rows (a prefill) in fp32, a few in the weight's dtype."""

    def product(self, rows_MK: Tensor) -> Tensor:
        return mm(rows_MK, self.weight.t())


class RowLinear(_PlainLinear):
    """An ``nn.Linear`` of a bf16 (or fp32) weight kept as it is, for the row layout: ``plain_linear``."""

    def product(self, rows_MK: Tensor) -> Tensor:
        return plain_linear(rows_MK, self.weight)


class RowRMSNorm(nn.Module):
    """An ``nn.RMSNorm`` of bf16 with a weight, for the row layout: ``kernels.rms_norm_bf16``, one call
    where torch's composite pays about ten ops (37-60 us a row of 1024 on a Zen 3, ad hoc)."""

    def __init__(self, norm: nn.RMSNorm) -> None:
        super().__init__()
        self.register_buffer("weight", norm.weight.detach().contiguous(), persistent=False)
        # NOTE: without an eps torch's bf16 RMSNorm adds fp32's machine epsilon, the dtype it computes in
        # (not bf16's, which its documentation names): tests/unit/test_infer_resident_experts.py
        self.eps = torch.finfo(torch.float32).eps if norm.eps is None else norm.eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm_bf16(x, self.weight, self.eps)


def _linear_rows(x: Tensor, product: Kernel, bias: Tensor | None) -> Tensor:
    """A linear layer's output from its weight's ``product`` over ``x``'s rows, plus ``bias``, shaped as ``x``."""
    y = product(x.reshape(-1, x.shape[-1]))
    y = y if bias is None else y + bias
    return y.view(*x.shape[:-1], y.shape[-1])


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is ``prepack``-ed."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("packed", prepack(linear.weight.detach()), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)
        self.out_features = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.packed, self.bias)


def quantize_experts_(model: nn.Module, fmt: str) -> nn.Module:
    """Swap every MoE layer's ``GroupedExperts`` for ``QuantizedExperts`` in place, one layer at a time
    (the full-precision weights of a layer are freed as its quantized ones are made)."""
    for moe in model.moe_layers():
        quantize_layer_experts_(moe, fmt)
    return model


def quantize_layer_experts_(moe: MoE, fmt: str) -> None:
    """``quantize_experts_`` of one MoE layer."""
    if fmt == "int4" and moe.experts.w_in.device.type != "cpu":
        raise OptionError("expert_format", "experts quantized in memory run on a CPU (torch's int4 CPU kernel)", fmt)
    if not isinstance(moe.experts, GroupedExperts):
        raise OptionError("expert_format", f"the experts are already {type(moe.experts).__name__}", fmt)
    moe.experts = QuantizedExperts(moe.experts, fmt)


HEAD_FORMAT = "int8"  # the output head's under either --dense-format (see quantize_dense_)
INT4_OUT_MULTIPLE = 16  # torch's int4 CPU packing takes output widths in multiples of 16


def quantize_dense_(model: nn.Module, fmt: str) -> nn.Module:
    """Swap, in place, the linear weights outside the routed experts for ``QuantizedLinear``: attention's
    projections, dense and shared FFNs, and the output head unless it is the embedding's (a quantized copy
    would be read beside it, not instead). Routers (computed in fp32, a few columns) and MLA's projections
    (its absorbed decode reads their weights) keep theirs. On a CPU only: on a GPU an int8 product would
    dequantize its weight first at any count of rows (``quant.int8_mm``), as a CPU does beyond
    ``INT8PACK_MAX_ROWS`` rows (a serving step of more sequences pays that for every dense weight).

    Under int4 the head is int8, as llama.cpp's Q4_K_M keeps its output at 6 bits: the head's error lands
    on the logits whole, where a layer's is one of many summed into the residual stream."""
    if fmt not in QUANT_FORMATS:
        raise OptionError("dense_format", f"choose from fp, {', '.join(QUANT_FORMATS)}", fmt)
    if model.embed.weight.device.type != "cpu":
        raise OptionError("dense_format", "dense weights quantized in memory run on a CPU", fmt)
    swaps = [(parent, name, HEAD_FORMAT if parent is model else fmt) for parent, name in _dense_linears(model)]
    for parent, name, child_fmt in swaps:
        linear = getattr(parent, name)
        if child_fmt == "int4" and (linear.in_features % INT4_GROUP or linear.out_features % INT4_OUT_MULTIPLE):
            raise OptionError(
                "dense_format",
                f"int4 needs input widths in multiples of {INT4_GROUP} and output widths in multiples of "
                f"{INT4_OUT_MULTIPLE} ({name}: {linear.in_features} -> {linear.out_features})",
                fmt,
            )
    for parent, name, child_fmt in swaps:  # one at a time: each full-precision weight freed as it goes
        setattr(parent, name, QuantizedLinear(getattr(parent, name), child_fmt))
    return model


def _dense_linears(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, name) of the plain ``nn.Linear`` weights outside the routed experts that inference swaps:
    attention's projections, dense and shared FFNs', and the output head (a child of the model) unless
    it is the embedding's."""
    found = []
    for parent in [model, *(m for m in model.modules() if isinstance(m, DenseFFN | Attention))]:
        for name, child in parent.named_children():
            head = parent is model and name == "lm_head"
            if type(child) is nn.Linear and (parent is not model or (head and not model.cfg.tie_embeddings)):
                found.append((parent, name))
    return found


def prepack_(model: nn.Module, few_rows: bool = False) -> nn.Module:
    """Swap, in place, the weights oneDNN multiplies faster prepacked (fp32, and 16-bit on a CPU with
    native 16-bit kernels): the routed experts left in full precision, attention's projections, dense
    and shared FFNs, and the output head unless it is the embedding's (a packed copy would double it
    outside the memory budget's count); offloaded experts are multiplied by the packed experts' kernel,
    over their slots' weights (``Offloader.use_packed_kernels``), so they compute what resident ones do. Routers
    (computed in fp32) keep theirs; MLA's projections too (its absorbed decode reads their weights).
    16-bit weights a CPU has no native kernels for get ``UpcastLinear`` (the experts already multiply by ``mm``),
    bf16 ones the row layout below where moekit's kernels run.

    ``few_rows`` (a batch-1 decode, ``moekit generate``'s default): bf16 weights stay in their plain
    layout instead (``RowExperts``, ``RowLinear``) and RMSNorms with a weight become ``RowRMSNorm``, where
    the row kernel runs (``kernels.rows_available``):
    2 threads, in one process taking turns (``python benchmarks/decode_layouts.py``), a decode step after
    a 512-token prompt 1.17x faster on d1024 and 1.15x on d2048, the prompt itself 0.86x / 0.89x (its
    products reorder the plain weights for oneDNN on each call). Steps of two or more sequences keep the packed
    layout, which oneDNN multiplies faster from two rows; on a CPU without native bf16 (AVX2), where
    oneDNN has no packed bf16 kernel, every bf16 load takes the row layout: served d1024 in bf16, 2
    threads, 1.43x at one client and 1.76x at 16 (``python benchmarks/serve_commits.py``,
    ``benchmarks/measured/serve-commits-d1024-avx2-rows.json``). Offloaded experts keep the packed experts'
    kernel over their slots, so under ``few_rows`` they compute what packed resident experts would, not
    what ``RowExperts`` do; on a CPU without native bf16 (no packed bf16 kernel) the row layout's
    kernel, over their slots.

    fp32 weights take the row layout too where ``experts.matmul.plain_fp32`` says (a CPU without AVX-512,
    where the fp32 row kernel reads a few rows' weights faster than oneDNN's prepacked kernel), unless the
    experts are offloaded: their slots hold fp32 weights ``[K, N]``, which the row kernel would need
    transposed at every product (5x the packed kernel's time over a kept reordered copy, ad hoc), so an
    offloaded fp32 model keeps the packed layout, as before."""
    weight = model.embed.weight  # the head's dtype and device (the head may be quantized already)
    # NOTE: without native bf16 (AVX2) the row kernel beats torch's at every count of rows it takes
    # (``experts.matmul.plain_linear``): the row layout then serves steps of several sequences too
    cpu = weight.device.type == "cpu"
    bf16_rows = cpu and weight.dtype == torch.bfloat16 and (few_rows or not native_16bit(torch.bfloat16))
    offloaded = any(isinstance(moe.experts, OffloadedExperts) for moe in model.moe_layers())
    fp32_rows = cpu and weight.dtype == torch.float32 and plain_fp32() and not offloaded
    rows = (bf16_rows and rows_available()) or fp32_rows
    if rows or prepackable(weight):
        experts, linear = (RowExperts, RowLinear) if rows else (PackedExperts, PackedLinear)
        for moe in model.moe_layers():
            if type(moe.experts) is GroupedExperts:
                moe.experts = experts(moe.experts)
            elif isinstance(moe.experts, OffloadedExperts):  # its slots are refilled: the kernel over them
                if prepackable(weight) and not fp32_rows:
                    moe.experts.offloader.use_packed_kernels(weight.dtype)
                else:
                    moe.experts.offloader.use_row_kernels()
    elif weight.device.type == "cpu" and weight.dtype in SIXTEEN_BIT:
        linear = UpcastLinear
    else:
        return model
    for parent, name in _dense_linears(model):
        setattr(parent, name, linear(getattr(parent, name)))
    if rows and weight.dtype == torch.bfloat16:
        for parent, name in _weighted_rms_norms(model):
            setattr(parent, name, RowRMSNorm(getattr(parent, name)))
    return model


def _weighted_rms_norms(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, name) of every ``nn.RMSNorm`` over one dim with a bf16 weight in CPU memory: the blocks',
    the final one, QK norms."""
    return [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.RMSNorm
        and child.weight is not None
        and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
        and len(child.normalized_shape) == 1
    ]
