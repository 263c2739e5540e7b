"""CPU kernels torch has no equal for, written in C and built at first use.

``rows_bf16`` (``decode.c``): the product of a few rows with a bf16 weight stored ``[N, K]``, a batch-1
decode step's work: it reads a plain weight faster than oneDNN reads its own prepacked copy (1024 x 4096
weights streamed in turn, 2 threads, ms per weight: one row 0.233 against 0.257 prepacked, two rows 0.260
against 0.245, four 0.339 against 0.197; oneDNN over the plain weight 0.33-0.50; ``python
benchmarks/cpu_matmul.py --threads 2 --rows 1 2 4 --rounds 3 --json``,
``benchmarks/measured/cpu-matmul-2-threads-rows.json``; ATen's GEMV over the plain weight with oneDNN
off, 0.232 at one row, matched it in that loop but not in a decode step: d1024 7.77 ms against 6.59,
d2048 13.92 against 12.03, ``python benchmarks/decode_layouts.py``). Inference keeps bf16 weights plain
for it where a decode multiplies ``FEW_ROWS`` row (``infer.resident_experts``' row layout). On a CPU
without native bf16 (AVX2), where torch has no packed bf16 kernel at all: 0.66 ms against torch's 0.87-0.89
at one row, 0.81 against 1.25-1.31 at two (``benchmarks/measured/cpu-matmul-2-threads-rows-avx2.json``).

``rows_int8``: the same for an int8 weight with per-output scales (``infer.quant``'s int8), widened to
fp32 in registers. ``rms_norm_bf16``: RMSNorm of bf16 rows in one call, where torch's composite pays
about ten ops.

``moe_token_bf16`` and ``attention_token_bf16``: a decode step's MoE layer (routing, SwiGLU experts,
combine) and attention half (RMSNorm, projections, RoPE, the cache's new position, attention), each
with its residual, in one call instead of dozens of torch ops (``infer.token_step`` takes them; what
they save: ``python benchmarks/decode_split.py DIR``).

``one_query_bf16``: one sequence's one-token attention over its cached bf16 keys and values, read in
place, where torch's path converts them to fp32 first and pays a dozen ops a layer (16 heads over 4
key/value heads of 64, 2 threads, a layer: 5.1 / 10.4 / 16.6 / 26.2 us against 27.2 / 41.5 / 58.8 /
94.9 at 64 / 256 / 512 / 1024 positions, ad hoc). ``model.sdpa.one_query`` takes it for one sequence,
every key visible (a contiguous ``KVCache``'s decode step; a server's paged steps pass a mask).

The library is compiled once per source, instruction set and compiler into the user's cache directory
(``$MOEKIT_CACHE``, else ``$XDG_CACHE_HOME/moekit`` or ``~/.cache/moekit``) by ``$CC`` (default ``cc``)
with OpenMP, for the best of ``ISAS`` this CPU runs (AVX512-BF16, else AVX2 with FMA: checked in
/proc/cpuinfo before anything is loaded, and again by the library; ``$MOEKIT_MAX_CPU_ISA`` caps it), then
loaded with ctypes. Where that fails (no compiler, another architecture) or the CPU runs neither build,
``rows_available()`` is False and inference keeps torch's kernels; ``rows_unavailable_reason()`` says
why. The AVX-512 build sums as AVX512-BF16 does: subnormal inputs count as zero, subnormal sums are
flushed; the AVX2 build sums subnormal inputs as they are and its softmax's exp gives 0 below 2^-126.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

# NOTE: rows up to which the row layout multiplies by rows_bf16 where oneDNN has native bf16: one. At two its
# prepacked kernel is already a little faster (0.245 against 0.260 ms above), so a decode of two sequences
# keeps the packed layout there; without native bf16 see experts.matmul.ROWS_WITHOUT_NATIVE.
FEW_ROWS = 1
SOURCE = Path(__file__).with_name("decode.c")
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")  # every build's: FMAs only where written
LIBRARIES = ("-lm",)  # linked after the source (expf)
MAX_EXPERTS = 4096  # moe_token_bf16's experts at most (the router's scores live on the calling thread's stack)
# The builds of decode.c, best first: the compiler's flags for each, and /proc/cpuinfo's names of what
# they need (decode.c checks the same at run time, moekit_rows_supported).
ISAS = {
    "avx512_bf16": (
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"),
        ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"),
    ),
    "avx2": (("-mavx2", "-mfma"), ("avx2", "fma")),
}
ISA_VARIABLE = "MOEKIT_MAX_CPU_ISA"  # caps the build used, as ONEDNN_MAX_CPU_ISA caps oneDNN's: one of ISAS, or none
BUILD_SECONDS = 120  # a compiler that takes longer is given up on


def cache_dir() -> Path:
    """Where built kernels are kept: ``$MOEKIT_CACHE``, else ``$XDG_CACHE_HOME/moekit``, else ``~/.cache/moekit``."""
    if os.environ.get("MOEKIT_CACHE"):
        return Path(os.environ["MOEKIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moekit"


def cpu_flags() -> set[str]:
    """The instruction sets /proc/cpuinfo lists (none off Linux, where it does not say)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def runnable_isas() -> list[str]:
    """The builds of ``ISAS`` this CPU runs, best first: checked before anything built for them is loaded."""
    flags = cpu_flags()
    return [isa for isa, (_, needs) in ISAS.items() if set(needs) <= flags]


def chosen_isa() -> tuple[str | None, str]:
    """The build this process uses (the best this CPU runs, at most ``$MOEKIT_MAX_CPU_ISA``), or None and
    why none. Raises ``ValueError`` for a setting that names no build."""
    cap = os.environ.get(ISA_VARIABLE, "").strip().lower()
    if cap and cap != "none" and cap not in ISAS:
        raise ValueError(f"{ISA_VARIABLE}={cap} is none of {', '.join(ISAS)}, none")
    if cap == "none":
        return None, f"{ISA_VARIABLE}=none"
    allowed = list(ISAS)[list(ISAS).index(cap) :] if cap else list(ISAS)
    runnable = [isa for isa in runnable_isas() if isa in allowed]
    if not runnable:
        lowest = ISAS[allowed[-1]][1]
        return None, f"this CPU lacks {', '.join(f for f in lowest if f not in cpu_flags())}"
    return runnable[0], ""


def build(source: Path, directory: Path, compiler: str, isa: str) -> Path:
    """The shared library of ``source`` for ``isa`` (an ``ISAS`` entry), compiled by ``compiler`` into
    ``directory`` unless a build of the same source and command is there already. Raises ``OSError`` with
    the compiler's first error line."""
    command = [*shlex.split(compiler), *FLAGS, *ISAS[isa][0]]
    digest = hashlib.sha256(source.read_bytes() + " ".join([*command, *LIBRARIES]).encode()).hexdigest()[:16]
    library = directory / f"{source.stem}-{isa}-{digest}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    # NOTE: built under a temporary name and renamed: processes building at once each get a whole file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        try:
            done = subprocess.run(
                [*command, str(source), "-o", partial, *LIBRARIES],
                capture_output=True,
                text=True,
                timeout=BUILD_SECONDS,
            )
        except OSError as err:
            raise OSError(f"{compiler}: {err.strerror}") from None
        except subprocess.TimeoutExpired:
            raise OSError(f"{compiler} took over {BUILD_SECONDS} s to build {source.name}") from None
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:200])
            raise OSError(f"{compiler} could not build {source.name}: {first}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o755 & ~umask)  # mkstemp's file is its owner's alone; others may share the cache
        os.replace(partial, library)
    finally:
        Path(partial).unlink(missing_ok=True)
    return library


def load(library: Path) -> ctypes.CDLL | None:
    """The built library, or None where this CPU lacks the instructions it was built for."""
    lib = ctypes.CDLL(str(library))
    if not lib.moekit_rows_supported():
        return None
    lib.moekit_rows_bf16.argtypes = [ctypes.c_int, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 3]
    lib.moekit_rows_bf16.restype = None
    strided = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # base, group stride, position stride
    lib.moekit_one_query_bf16.argtypes = [
        ctypes.c_int,
        *[ctypes.c_int64] * 4,
        ctypes.c_float,
        ctypes.c_void_p,
        *strided,
        *strided,
        *[ctypes.c_void_p] * 2,
    ]
    lib.moekit_one_query_bf16.restype = None
    lib.moekit_rms_norm_bf16.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    lib.moekit_rms_norm_bf16.argtypes += [ctypes.c_void_p] * 3
    lib.moekit_rms_norm_bf16.restype = None
    lib.moekit_rows_int8.argtypes = [ctypes.c_int, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 4]
    lib.moekit_rows_int8.restype = None
    lib.moekit_moe_token_bf16.argtypes = [ctypes.c_int, *[ctypes.c_int64] * 4, *[ctypes.c_void_p] * 4, ctypes.c_int]
    lib.moekit_moe_token_bf16.argtypes += [ctypes.c_float, *[ctypes.c_void_p] * 12]
    lib.moekit_moe_token_bf16.restype = None
    lib.moekit_attention_token_bf16.argtypes = [ctypes.c_int, *[ctypes.c_int64] * 5, ctypes.c_float, ctypes.c_float]
    lib.moekit_attention_token_bf16.argtypes += [*[ctypes.c_void_p] * 8, ctypes.c_int64, *[ctypes.c_void_p] * 6]
    lib.moekit_attention_token_bf16.restype = None
    return lib


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str, bool, str | None]:
    """The kernels of this process, built and loaded once (``$MOEKIT_MAX_CPU_ISA`` is read then, not
    after); or None, why not, and whether the build failed (something a user can mend: no compiler, an
    unwritable cache, a bad setting) rather than the CPU; and the build loaded."""
    try:
        isa, why = chosen_isa()
        if isa is None:
            return None, why, False, None
        lib = load(build(SOURCE, cache_dir() / "kernels", os.environ.get("CC", "cc"), isa))
    except (OSError, ValueError, RuntimeError) as err:  # no compiler, a bad $CC, no home directory
        return None, str(err), True, None
    if lib is None:
        return None, f"this CPU does not run the {isa} build", False, None
    return lib, "", False, isa


def rows_available() -> bool:
    """Whether ``rows_bf16`` runs here (built, and the CPU runs the build)."""
    return _library()[0] is not None


def rows_isa() -> str | None:
    """The ``ISAS`` build this process loaded, or None."""
    return _library()[3]


def rows_unavailable_reason() -> str:
    """Why ``rows_available()`` is False ("" where it is True)."""
    return _library()[1]


def rows_build_failure() -> str:
    """Why the row kernel is unavailable on a CPU that runs one of its builds (no compiler, a failed or
    unwritable build, a ``$MOEKIT_MAX_CPU_ISA`` that names none: something a user can mend), or "" where
    it runs, the CPU could never run it or ``$MOEKIT_MAX_CPU_ISA=none`` turned it off."""
    _, why, failed, _ = _library()
    return why if failed else ""


def rows_bf16(x_MK: Tensor, w_NK: Tensor) -> Tensor:
    """``x @ w.t()`` for bf16 rows ``x`` [M, K] and a bf16 weight ``w`` [N, K] stored row-major, summed in fp32
    and rounded to bf16: ``[M, N]``. Any M; meant for a few (``experts.matmul.plain_linear`` says how many)."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"the row kernels are unavailable: {rows_unavailable_reason()}")
    M, K = x_MK.shape
    N = w_NK.shape[0]
    if x_MK.dtype != torch.bfloat16 or w_NK.dtype != torch.bfloat16 or w_NK.shape[1] != K:
        given = f"{x_MK.dtype} {list(x_MK.shape)} and {w_NK.dtype} {list(w_NK.shape)}"
        raise ValueError(f"rows_bf16 takes bf16 rows [M, K] and a bf16 weight [N, K], not {given}")
    if not w_NK.is_contiguous() or x_MK.device.type != "cpu" or w_NK.device.type != "cpu":
        raise ValueError("rows_bf16 takes a contiguous weight in CPU memory")
    if torch.is_grad_enabled() and (x_MK.requires_grad or w_NK.requires_grad):
        raise RuntimeError("rows_bf16 is for inference: it records no gradient")
    x = x_MK.contiguous()
    y = torch.empty(M, N, dtype=torch.bfloat16, device="cpu")
    lib.moekit_rows_bf16(torch.get_num_threads(), M, N, K, x.data_ptr(), w_NK.data_ptr(), y.data_ptr())
    return y


def rows_int8(x_MK: Tensor, q_NK: Tensor, scale_N: Tensor) -> Tensor:
    """``x @ (q * scale[:, None]).t()`` for rows ``x`` [M, K] (any float dtype, widened to fp32), an int8
    weight ``q`` [N, K] stored row-major and its fp32 per-output scales ``scale`` [N]: summed in fp32,
    times the scale, rounded to bf16 once: ``[M, N]`` bf16. Any M; meant for ``FEW_ROWS`` or fewer."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"the row kernels are unavailable: {rows_unavailable_reason()}")
    M, K = x_MK.shape
    N = q_NK.shape[0]
    if q_NK.dtype != torch.int8 or q_NK.shape[1] != K or scale_N.shape != (N,) or not x_MK.is_floating_point():
        given = f"{x_MK.dtype} {list(x_MK.shape)}, {q_NK.dtype} {list(q_NK.shape)} and {list(scale_N.shape)}"
        raise ValueError(f"rows_int8 takes rows [M, K], an int8 weight [N, K] and scales [N], not {given}")
    if not q_NK.is_contiguous() or any(t.device.type != "cpu" for t in (x_MK, q_NK, scale_N)):
        raise ValueError("rows_int8 takes a contiguous weight in CPU memory")
    if x_MK.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("rows_int8 is for inference: it records no gradient")
    x, scale = x_MK.float().contiguous(), scale_N.float().contiguous()
    y = torch.empty(M, N, dtype=torch.bfloat16, device="cpu")
    lib.moekit_rows_int8(
        torch.get_num_threads(), M, N, K, x.data_ptr(), q_NK.data_ptr(), scale.data_ptr(), y.data_ptr()
    )
    return y


def one_query_takes(q_Hd: Tensor, k_GSd: Tensor, v_GSd: Tensor) -> bool:
    """Whether ``one_query_bf16`` computes this attention: bf16 on a CPU, head dim a multiple of 32 up to
    128, whole groups of query heads, each position's key and value contiguous, and the kernel built."""
    tensors = (q_Hd, k_GSd, v_GSd)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(-1) != 1 for t in tensors):
        return False
    (H, d), G = q_Hd.shape, k_GSd.shape[0]
    shapes = k_GSd.shape == v_GSd.shape and k_GSd.shape[-1] == d
    return shapes and d % 32 == 0 and d <= 128 and H % G == 0 and q_Hd.is_contiguous() and rows_available()


def one_query_bf16(q_Hd: Tensor, k_GSd: Tensor, v_GSd: Tensor, scale: float) -> Tensor:
    """``softmax(q k^T * scale) v`` per head for one query per head ``q`` [H, d] over keys and values
    ``[G, S, d]`` (query head h reads group ``h // (H / G)``), every key visible: ``[H, d]`` in bf16, the
    scores, softmax and sums in fp32. Where ``one_query_takes``."""
    lib = _library()[0]
    if lib is None or not one_query_takes(q_Hd, k_GSd, v_GSd):
        raise ValueError("one_query_bf16 takes bf16 CPU tensors, head dim a multiple of 32 up to 128")
    (H, d), (G, S) = q_Hd.shape, k_GSd.shape[:2]
    scores = torch.empty(H, S, dtype=torch.float32, device="cpu")  # the C code writes fp32, whatever torch's default
    out = torch.empty(H, d, dtype=torch.bfloat16, device="cpu")
    k, v = (k_GSd.data_ptr(), k_GSd.stride(0), k_GSd.stride(1)), (v_GSd.data_ptr(), v_GSd.stride(0), v_GSd.stride(1))
    threads = torch.get_num_threads()
    lib.moekit_one_query_bf16(threads, H, G, S, d, scale, q_Hd.data_ptr(), *k, *v, scores.data_ptr(), out.data_ptr())
    return out


def rms_norm_bf16(x: Tensor, weight_D: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of bf16 ``x`` with a contiguous bf16 ``weight`` [D]: ``x / sqrt(mean(x^2) +
    eps) * weight`` in fp32, rounded to bf16 once; shaped as ``x``. Where ``rows_available()``."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"the row kernels are unavailable: {rows_unavailable_reason()}")
    D = weight_D.shape[0]
    # NOTE: checks kept to a few attribute reads: a decode step calls this twice a layer
    if x.dtype != torch.bfloat16 or weight_D.dtype != torch.bfloat16 or x.shape[-1] != D:
        raise ValueError(f"rms_norm_bf16 takes bf16 rows [..., {D}] and weight [{D}], not {x.dtype} {list(x.shape)}")
    if x.device.type != "cpu" or weight_D.device.type != "cpu" or not weight_D.is_contiguous():
        raise ValueError("rms_norm_bf16 takes CPU tensors and a contiguous weight")
    if (x.requires_grad or weight_D.requires_grad) and torch.is_grad_enabled():
        raise RuntimeError("rms_norm_bf16 is for inference: it records no gradient")
    rows = x.contiguous()
    y = torch.empty_like(rows)
    lib.moekit_rms_norm_bf16(
        torch.get_num_threads(), rows.numel() // D, D, eps, rows.data_ptr(), weight_D.data_ptr(), y.data_ptr()
    )
    return y


def _weight(name: str, w: Tensor, scale: Tensor | None) -> tuple[int, int | None]:
    """A one-token call's weight: bf16 (``scale`` None) or int8 with fp32 per-output scales [..., N]
    (``infer.quant``'s int8), contiguous in CPU memory: its and its scales' addresses."""
    if scale is None and w.dtype == torch.bfloat16:
        pass
    elif w.dtype != torch.int8 or scale is None or scale.dtype != torch.float32 or scale.shape != w.shape[:-1]:
        given = f"{w.dtype} {list(w.shape)} and {None if scale is None else list(scale.shape)} scales"
        raise ValueError(f"{name}: a bf16 weight, or int8 with fp32 scales per output, not {given}")
    if w.device.type != "cpu" or not w.is_contiguous() or (scale is not None and not scale.is_contiguous()):
        raise ValueError(f"{name}: a contiguous weight in CPU memory")
    return w.data_ptr(), None if scale is None else scale.data_ptr()


def moe_token_bf16(
    x_D: Tensor,
    residual_D: Tensor,
    router_ED: Tensor,
    router_bias_E: Tensor | None,
    selection_bias_E: Tensor,
    top_k: int,
    normalize: bool,
    route_scale: float,
    w_in_END: Tensor,
    w_out_EDN: Tensor,
    w_in_scale_EN: Tensor | None = None,
    w_out_scale_ED: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One token through a MoE layer's routed SwiGLU experts and the residual around them, in one call
    (``decode.c``'s ``moekit_moe_token_bf16``): fp32 router logits ``x @ router.t() + bias``, softmax, the
    ``top_k`` best by score plus ``selection_bias``, renormalised when ``normalize``, times ``route_scale``;
    each picked expert ``silu(gate) * up`` with ``w_in`` [E, 2F, D] (gate rows first) and ``w_out`` [E, D, F],
    output-major, bf16 or int8 with their scales (``_weight``); returns ``residual + sum_k bf16(w_k) y_k``
    [D] and the picked experts [top_k] (ascending). Every product is summed in fp32 and rounded to bf16, as
    torch's ops round them. What differs from torch's ops: the order of the fp32 sums, silu's and the
    softmax's exp (the C library's; the softmax divides by the sum), and ties between scores, which go
    to the lower index."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"the row kernels are unavailable: {rows_unavailable_reason()}")
    E, N, D = w_in_END.shape
    F = N // 2
    if w_out_EDN.shape != (E, D, F) or 2 * F != N:
        raise ValueError(f"moe_token_bf16 takes w_in [E, 2F, D] and w_out [E, D, F], not {list(w_in_END.shape)}")
    w_in = _weight("w_in", w_in_END, w_in_scale_EN)
    w_out = _weight("w_out", w_out_EDN, w_out_scale_ED)
    fp32 = (router_ED, selection_bias_E) if router_bias_E is None else (router_ED, selection_bias_E, router_bias_E)
    shapes = router_ED.shape == (E, D) and all(t.shape == (E,) for t in fp32[1:])
    if not shapes or any(t.dtype != torch.float32 for t in fp32) or not 0 < top_k <= E <= MAX_EXPERTS:
        raise ValueError(
            f"moe_token_bf16 takes an fp32 router [{E}, {D}], biases [{E}] and 1 to {E} picks, not {top_k}"
        )
    if any(t.shape != (D,) or t.dtype != torch.bfloat16 for t in (x_D, residual_D)):
        raise ValueError(f"moe_token_bf16 takes one token's bf16 x and residual [{D}]")
    tensors = (x_D, residual_D, *fp32)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("moe_token_bf16 takes contiguous CPU tensors")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("moe_token_bf16 is for inference: it records no gradient")
    scratch = torch.empty(N + F + top_k * D, dtype=torch.bfloat16)
    h, a, y = scratch.split([N, F, top_k * D])
    widened = torch.empty(D + F, dtype=torch.float32)
    out = torch.empty(D, dtype=torch.bfloat16)
    picked = torch.empty(top_k, dtype=torch.int64)
    weights = torch.empty(top_k, dtype=torch.float32)
    lib.moekit_moe_token_bf16(
        torch.get_num_threads(),
        D,
        F,
        E,
        top_k,
        x_D.data_ptr(),
        router_ED.data_ptr(),
        None if router_bias_E is None else router_bias_E.data_ptr(),
        selection_bias_E.data_ptr(),
        int(normalize),
        route_scale,
        *w_in,
        *w_out,
        residual_D.data_ptr(),
        h.data_ptr(),
        a.data_ptr(),
        y.data_ptr(),
        widened.data_ptr(),
        out.data_ptr(),
        picked.data_ptr(),
        weights.data_ptr(),
    )
    return out, picked


def attention_token_bf16(
    x_D: Tensor,
    norm_D: Tensor,
    eps: float,
    qkv_ND: Tensor,
    qkv_bias_N: Tensor | None,
    rope_d2: Tensor,
    keys_GSd: Tensor,
    values_GSd: Tensor,
    position: int,
    heads: int,
    out_DN: Tensor,
    out_bias_D: Tensor | None,
    qkv_scale_N: Tensor | None = None,
    out_scale_D: Tensor | None = None,
) -> Tensor:
    """One token through a block's attention half and the residual around it, in one call (``decode.c``'s
    ``moekit_attention_token_bf16``): ``x + out(attend(rope(qkv(rms_norm(x)))))`` [D], ``qkv`` laid out per
    key/value group as moekit's ``Attention`` lays it out, ``heads`` query heads over the G groups of the
    cache ``keys``/``values`` [G, S, d] (a ``KVCache`` layer's, written in place at ``position``, attended up
    to it), ``rope`` [d/2, 2] this position's (cos, sin) in fp32. The projections bf16 or int8 with their
    scales (``_weight``). Rounded to bf16 where torch's ops round; the products and the attention are
    ``rows_bf16``'s (``rows_int8``'s) and ``one_query_bf16``'s."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"the row kernels are unavailable: {rows_unavailable_reason()}")
    (D,), (G, S, d) = x_D.shape, keys_GSd.shape
    qkv = _weight("qkv", qkv_ND, qkv_scale_N)
    out_w = _weight("out", out_DN, out_scale_D)
    bf16 = [x_D, norm_D, keys_GSd, values_GSd, *(b for b in (qkv_bias_N, out_bias_D) if b is not None)]
    shapes = qkv_ND.shape == ((heads + 2 * G) * d, D) and out_DN.shape == (D, heads * d) and norm_D.shape == (D,)
    shapes &= (qkv_bias_N is None or qkv_bias_N.shape == qkv_ND.shape[:1]) and (
        out_bias_D is None or out_bias_D.shape == (D,)
    )
    if any(t.dtype != torch.bfloat16 for t in bf16) or not shapes or values_GSd.shape != keys_GSd.shape:
        raise ValueError(f"attention_token_bf16 takes bf16 weights for {heads} heads over {G} groups of {d}")
    rope = rope_d2.shape == (d // 2, 2) and rope_d2.dtype == torch.float32
    if heads % G or d % 32 or d > 128 or not 0 <= position < S or not rope:
        raise ValueError(f"attention_token_bf16 takes heads of 32 to 128, not {d}, at a cached position: {position}")
    laid_out = all(t.is_contiguous() for t in bf16[:2] + bf16[4:]) and rope_d2.is_contiguous()
    cached = (keys_GSd, values_GSd)
    positions = all(t.stride(1) == d and t.stride(2) == 1 and t.stride(0) == keys_GSd.stride(0) for t in cached)
    if not laid_out or not positions or any(t.device.type != "cpu" for t in bf16):
        raise ValueError("attention_token_bf16 takes contiguous CPU weights and a cache of contiguous positions")
    if torch.is_grad_enabled() and any(t.requires_grad for t in bf16):
        raise RuntimeError("attention_token_bf16 is for inference: it records no gradient")
    scratch = torch.empty(D + (3 * heads + 2 * G) * d, dtype=torch.bfloat16)  # normed, qkv, queries, attended
    scores = torch.empty(heads * (position + 1) + D + heads * d, dtype=torch.float32)  # and the widened rows
    out = torch.empty(D, dtype=torch.bfloat16)
    lib.moekit_attention_token_bf16(
        torch.get_num_threads(),
        D,
        heads,
        G,
        d,
        position,
        eps,
        d**-0.5,
        x_D.data_ptr(),
        norm_D.data_ptr(),
        *qkv,
        None if qkv_bias_N is None else qkv_bias_N.data_ptr(),
        rope_d2.data_ptr(),
        keys_GSd.data_ptr(),
        values_GSd.data_ptr(),
        keys_GSd.stride(0),
        *out_w,
        None if out_bias_D is None else out_bias_D.data_ptr(),
        scratch.data_ptr(),
        scores.data_ptr(),
        out.data_ptr(),
    )
    return out
