"""The implementations ``moe_layer.py`` times, all built from one moekit layer's weights on one device and
dtype: moekit, per-expert loops, transformers' MoE blocks, the balanced limits and one dense GEMM.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K picks per token.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit import MoE, MoEConfig
from moekit.config import GEMM_BACKENDS
from moekit.dispatch import LocalDispatcher

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GPU_ONLY_MODES = ("deepgemm", "sonicmoe")  # transformers experts implementations needing CUDA kernels


@dataclass(frozen=True)
class Shape:
    name: str
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    tokens: int

    def expert_flops(self, backward: bool) -> float:
        return 6 * self.tokens * self.top_k * self.d_model * self.d_ff * (3 if backward else 1)


@dataclass(frozen=True)
class Target:
    """Where every weight, input and impl lives."""

    device: torch.device
    dtype: torch.dtype

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @contextlib.contextmanager
    def building(self):
        """Factory functions (``torch.randn``, modules' parameters) make tensors on the device and dtype."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                yield
        finally:
            torch.set_default_dtype(previous)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free_memory(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def memory_bytes(self) -> int:
        """Free GPU memory on cuda, physical memory on CPU."""
        if self.cuda:
            return torch.cuda.mem_get_info(self.device)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def describe(self) -> str:
        """The device and dtype, as the report's header gives them."""
        dtype = next(k for k, v in DTYPES.items() if v == self.dtype)
        if not self.cuda:
            return f"CPU, {dtype}"
        major, minor = torch.cuda.get_device_capability(self.device)
        return f"{torch.cuda.get_device_name(self.device)} (compute capability {major}.{minor}), {dtype}"


@dataclass
class Case:
    run: Callable[[], Tensor]  # one forward; returns the output
    leaves: list[Tensor]  # tensors whose .grad is reset before each call
    checked: bool = True  # computes moekit-dropless's function on the shared input


# ---------------------------------------------------------------------------------------------
# The implementations, all built from one moekit layer's weights.


class PerExpertLoop(nn.Module):
    """transformers' Mixtral block before v5: experts as separate ``nn.Linear`` modules, one loop."""

    def __init__(self, moe: MoE, fused: bool) -> None:
        super().__init__()
        self.top_k, self.fused = moe.cfg.top_k, fused
        self.gate = linear(moe.router.gate.weight.t())
        self.experts = nn.ModuleList()
        for w_in, w_out in zip(moe.experts.w_in, moe.experts.w_out, strict=True):
            first = [w_in] if fused else w_in.chunk(2, dim=1)  # [gate | up], or w1 (gate) and w3 (up)
            self.experts.append(nn.ModuleList([*map(linear, first), linear(w_out)]))

    def expert(self, e: int, x_RD: Tensor) -> Tensor:
        *first, down = self.experts[e]
        gate, up = first[0](x_RD).chunk(2, dim=-1) if self.fused else (first[0](x_RD), first[1](x_RD))
        return down(F.silu(gate) * up)

    def forward(self, x_TD: Tensor) -> Tensor:
        probs = F.softmax(self.gate(x_TD), dim=1, dtype=torch.float)
        weights_TK, experts_TK = torch.topk(probs, self.top_k, dim=-1)
        weights_TK = (weights_TK / weights_TK.sum(dim=-1, keepdim=True)).to(x_TD.dtype)
        out = torch.zeros_like(x_TD)
        mask_EKT = F.one_hot(experts_TK, num_classes=len(self.experts)).permute(2, 1, 0)
        for e in torch.greater(mask_EKT.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
            pick, tokens = torch.where(mask_EKT[e])
            out.index_add_(0, tokens, self.expert(e, x_TD[tokens]) * weights_TK[tokens, pick, None])
        return out


def linear(w_IO: Tensor) -> nn.Linear:
    """A bias-free ``nn.Linear`` holding a copy of ``w_IO`` (moekit's [in, out] layout)."""
    layer = nn.Linear(*w_IO.shape, bias=False, device=w_IO.device, dtype=w_IO.dtype)
    layer.weight.data.copy_(w_IO.detach().t())
    return layer


def transformers_blocks(s: Shape, moe: MoE, target: Target) -> tuple[dict[str, tuple[nn.Module, str]], list[str]]:
    """``hf-<family>/<mode>``: (block, experts implementation) for each mode that runs here; and notes.

    Mixtral and Qwen3-MoE share one copy of the weights in transformers' own layout
    (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``). Built under ``target.building()``.
    """
    try:
        from transformers import MixtralConfig, Qwen3MoeConfig
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        dims = dict(hidden_size=s.d_model, num_experts_per_tok=s.top_k, hidden_act="silu")
        blocks = {
            "mixtral": MixtralSparseMoeBlock(
                MixtralConfig(
                    **dims, intermediate_size=s.d_ff, num_local_experts=s.num_experts, router_jitter_noise=0.0
                )
            ),
            "qwen3_moe": Qwen3MoeSparseMoeBlock(
                Qwen3MoeConfig(**dims, moe_intermediate_size=s.d_ff, num_experts=s.num_experts, norm_topk_prob=True)
            ),
        }
    except Exception as e:  # a transformers version without these blocks, or with other config fields
        return {}, [f"transformers blocks left out: {reason(e)}"]
    shared = {
        "weight": nn.Parameter(moe.router.gate.weight.detach().clone()),
        "gate_up_proj": nn.Parameter(moe.experts.w_in.detach().transpose(1, 2).contiguous()),
        "down_proj": nn.Parameter(moe.experts.w_out.detach().transpose(1, 2).contiguous()),
    }
    for block in blocks.values():
        block.gate.weight = shared["weight"]
        block.experts.gate_up_proj, block.experts.down_proj = shared["gate_up_proj"], shared["down_proj"]
    notes, modes = [], ["eager", *ALL_EXPERTS_FUNCTIONS]
    batched_bytes = s.tokens * s.top_k * 3 * s.d_model * s.d_ff * target.dtype.itemsize
    if not target.cuda:
        notes += [f"hf-*/{mode} left out: CUDA kernels only" for mode in modes if mode in GPU_ONLY_MODES]
    if "batched_mm" in modes and batched_bytes > target.memory_bytes() / 4:
        modes.remove("batched_mm")
        notes.append(f"hf-*/batched_mm left out: it copies the weights per assignment, {batched_bytes / 2**30:.0f} GiB")
    runnable = [m for m in modes if target.cuda or m not in GPU_ONLY_MODES]
    return {f"hf-{f}/{m}": (block, m) for f, block in blocks.items() for m in runnable}, notes


def limit_forms(s: Shape) -> dict[str, Case]:
    """The balanced, routing-free expert FFN in each dense form; each returns the output."""
    per_expert = s.tokens * s.top_k // s.num_experts
    x = torch.randn(s.num_experts, per_expert, s.d_model, requires_grad=True)
    w1, w3 = (torch.randn(s.num_experts, s.d_model, s.d_ff, requires_grad=True) for _ in range(2))
    w13 = torch.cat([w1, w3], dim=-1).detach().requires_grad_()
    w2 = torch.randn(s.num_experts, s.d_ff, s.d_model, requires_grad=True)
    x_flat = x.detach().reshape(-1, s.d_model).requires_grad_()
    offsets = torch.arange(1, s.num_experts + 1, dtype=torch.int32) * per_expert

    def bmm3():
        return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)

    def bmm2():
        gate, up = torch.bmm(x, w13).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, w2)

    def grouped():
        gate, up = torch._grouped_mm(x_flat, w13, offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2, offs=offsets)

    forms = {"limit-bmm": Case(bmm3, [x, w1, w3, w2], False), "limit-bmm-fused": Case(bmm2, [x, w13, w2], False)}
    if hasattr(torch, "_grouped_mm"):
        forms["limit-grouped_mm"] = Case(grouped, [x_flat, w13, w2], False)
    return forms


def dense_gemm(s: Shape) -> Case:
    """One matmul with the experts' FLOPs: [T*K, D] @ [D, 3F] (2 * T*K * D * 3F = 6*T*K*D*F)."""
    x = torch.randn(s.tokens * s.top_k, s.d_model, requires_grad=True)
    w = torch.randn(s.d_model, 3 * s.d_ff, requires_grad=True)
    return Case(lambda: x @ w, [x, w], False)


def make_cases(s: Shape, target: Target) -> tuple[dict[str, Case], MoE, Tensor, list[str]]:
    """Every impl over one input ``x [T, D]``; also the moekit layer and notes on what was left out.
    Built under ``target.building()``."""
    moe = MoE(MoEConfig(d_model=s.d_model, d_ff=s.d_ff, num_experts=s.num_experts, top_k=s.top_k))
    dropless, capacity = moe.dispatcher, LocalDispatcher(s.num_experts, capacity_factor=1.25)
    x = torch.randn(s.tokens, s.d_model, requires_grad=True)

    def moekit(backend: str, dispatcher: LocalDispatcher = dropless, checked: bool = True) -> Case:
        def run() -> Tensor:
            moe.experts.gemm, moe.dispatcher = backend, dispatcher
            return moe(x)

        return Case(run, [x, *moe.parameters()], checked)

    cases = {"moekit-dropless": moekit("auto")}
    cases |= {f"moekit-dropless/{b}": moekit(b) for b in GEMM_BACKENDS if b != "auto"}
    cases["moekit-capacity"] = moekit("auto", capacity, checked=False)
    for name, fused in (("loop-linear", False), ("loop-linear-fused", True)):
        loop = PerExpertLoop(moe, fused)
        cases[name] = Case(lambda m=loop: m(x), [x, *loop.parameters()])
    blocks, notes = transformers_blocks(s, moe, target)
    for name, (block, mode) in blocks.items():
        cases[name] = Case(lambda b=block, m=mode: run_hf(b, m, x), [x, *block.parameters()])
    cases |= limit_forms(s)
    cases["dense-gemm"] = dense_gemm(s)
    with torch.no_grad():
        moe.dispatcher = capacity
        dropped = moe(x, return_stats=True)[1].num_dropped
    notes.append(f"moekit-capacity drops {dropped} of {s.tokens * s.top_k} assignments")
    return cases, moe, x, notes


def run_hf(block: nn.Module, mode: str, x_TD: Tensor) -> Tensor:
    block.experts.config._experts_implementation = mode
    out = block(x_TD.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).squeeze(0)  # some versions also return router logits


def reason(e: Exception) -> str:
    """An exception in one line: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160] if lines else ''}".rstrip(": ")
