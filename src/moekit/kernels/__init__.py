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
There, from three rows (a serving step's several sequences), it widens the rows once and keeps the weight
in L2-sized chunks, each met by every row and prefetched a chunk ahead, where streaming the whole weight
per pair of rows left it compute-bound: per 1024 x 4096 weight, 2 threads, a Zen 3, ad hoc, interleaved,
0.80 ms against 0.98 at 4 rows, 1.23 against 1.61 at 7, 2.34 against 2.62 at 16; a served d1024 step of
16 sequences decoding 163 ms against 193 (``experts.matmul.plain_linear`` has where ``mm`` takes over).

``rows_f32``: the same for fp32 rows and an fp32 weight, where ``experts.matmul.plain_fp32`` keeps fp32
weights plain (a CPU without AVX-512): per 1024 x 4096 weight, 2 threads, a Zen 3, ad hoc, 0.98 ms against
oneDNN's prepacked 1.41 at one row, 1.21 against 1.75 at four, 2.51 against 2.67 at 16, slower from 32.

``rows_int8``: the same for an int8 weight with per-output scales (``infer.quant``'s int8), widened to
fp32 in registers. ``rms_norm_bf16``: RMSNorm of bf16 rows in one call, where torch's composite pays
about ten ops.

``moe_token_bf16`` and ``attention_token_bf16``: a decode step's MoE layer (routing, SwiGLU experts,
combine) and attention half (RMSNorm, projections, RoPE, the cache's new position, attention), each
with its residual, in one call instead of dozens of torch ops; ``blocks_token_bf16``: every block of a
decode step in one call (``infer.token_step`` takes them; what they save: ``python
benchmarks/decode_split.py DIR``).

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
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

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
    lib.moekit_rows_f32.argtypes = lib.moekit_rows_bf16.argtypes
    lib.moekit_rows_f32.restype = None
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
    layers = [ctypes.c_void_p, ctypes.c_void_p]  # decode.c's attention_layer and moe_layer arrays
    lib.moekit_moe_token_bf16.argtypes = [ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * 6]
    lib.moekit_attention_token_bf16.argtypes = [ctypes.c_int, *[ctypes.c_int64] * 2, *[ctypes.c_void_p] * 6]
    lib.moekit_blocks_token_bf16.argtypes = [ctypes.c_int, *[ctypes.c_int64] * 3, *layers, *[ctypes.c_void_p] * 4]
    for name in ("moekit_moe_token_bf16", "moekit_attention_token_bf16", "moekit_blocks_token_bf16"):
        getattr(lib, name).restype = None
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


def _library_or_raise() -> ctypes.CDLL:
    """The loaded kernels, or a RuntimeError that says why there are none."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"the row kernels are unavailable: {rows_unavailable_reason()}")
    return lib


def rows_bf16(x_MK: Tensor, w_NK: Tensor) -> Tensor:
    """``x @ w.t()`` for bf16 rows ``x`` [M, K] and a bf16 weight ``w`` [N, K] stored row-major, summed in fp32
    and rounded to bf16: ``[M, N]``. Any M; meant for a few (``experts.matmul.plain_linear`` says how many)."""
    return _rows("rows_bf16", "bf16", "a", torch.bfloat16, x_MK, w_NK)


def rows_f32(x_MK: Tensor, w_NK: Tensor) -> Tensor:
    """``x @ w.t()`` for fp32 rows ``x`` [M, K] and an fp32 weight ``w`` [N, K] stored row-major, summed in
    fp32: ``[M, N]``, each output summed in the same order whatever M. Any M; meant for a few
    (``experts.matmul.plain_linear`` says how many)."""
    return _rows("rows_f32", "fp32", "an", torch.float32, x_MK, w_NK)


def _rows(name: str, kind: str, article: str, dtype: torch.dtype, x_MK: Tensor, w_NK: Tensor) -> Tensor:
    """``rows_bf16`` or ``rows_f32`` (``name``): checked, then one call of decode.c's ``moekit_<name>``."""
    lib = _library_or_raise()
    M, K = x_MK.shape
    N = w_NK.shape[0]
    if x_MK.dtype != dtype or w_NK.dtype != dtype or w_NK.shape[1] != K:
        given = f"{x_MK.dtype} {list(x_MK.shape)} and {w_NK.dtype} {list(w_NK.shape)}"
        raise ValueError(f"{name} takes {kind} rows [M, K] and {article} {kind} weight [N, K], not {given}")
    if not w_NK.is_contiguous() or x_MK.device.type != "cpu" or w_NK.device.type != "cpu":
        raise ValueError(f"{name} takes a contiguous weight in CPU memory")
    if torch.is_grad_enabled() and (x_MK.requires_grad or w_NK.requires_grad):
        raise RuntimeError(f"{name} is for inference: it records no gradient")
    x = x_MK.contiguous()
    y = torch.empty(M, N, dtype=dtype, device="cpu")
    getattr(lib, f"moekit_{name}")(torch.get_num_threads(), M, N, K, x.data_ptr(), w_NK.data_ptr(), y.data_ptr())
    return y


def rows_int8(x_MK: Tensor, q_NK: Tensor, scale_N: Tensor) -> Tensor:
    """``x @ (q * scale[:, None]).t()`` for rows ``x`` [M, K] (any float dtype, widened to fp32), an int8
    weight ``q`` [N, K] stored row-major and its fp32 per-output scales ``scale`` [N]: summed in fp32,
    times the scale, rounded to bf16 once: ``[M, N]`` bf16. Any M; meant for ``FEW_ROWS`` or fewer."""
    lib = _library_or_raise()
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
    lib = _library_or_raise()
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


class _Weight(ctypes.Structure):  # decode.c's weight
    _fields_ = [("data", ctypes.c_void_p), ("scale", ctypes.c_void_p)]


class _AttentionLayer(ctypes.Structure):  # decode.c's attention_layer
    _fields_ = [
        ("norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("qkv", _Weight),
        ("qkv_b", ctypes.c_void_p),
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in ("gs", "heads", "groups", "head_dim")),
        ("out", _Weight),
        ("out_b", ctypes.c_void_p),
        ("scale", ctypes.c_float),
    ]


class _MoELayer(ctypes.Structure):  # decode.c's moe_layer
    _fields_ = [
        ("norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("router", "router_bias", "selection_bias")),
        *((name, ctypes.c_int64) for name in ("experts", "hidden", "top_k")),
        ("normalize", ctypes.c_int),
        ("route_scale", ctypes.c_float),
        ("w_in", _Weight),
        ("w_out", _Weight),
        ("picked", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
    ]


class AttentionWeights(NamedTuple):
    """A block's attention half for the one-token calls: its RMSNorm ``norm`` [D] and ``eps``; ``qkv`` [(H +
    2G) d, D] laid out per key/value group as moekit's ``Attention`` lays it out, its bias [(H + 2G) d] or
    None; one sequence's cached ``keys`` and ``values`` [G, S, d] (a ``KVCache`` layer's, written in place);
    ``heads`` (H) query heads; ``out`` [D, H d], its bias [D] or None. The projections bf16, or int8 with
    fp32 per-output scales (``qkv_scale`` [(H + 2G) d], ``out_scale`` [D]; None: bf16)."""

    norm_D: Tensor
    eps: float
    qkv_ND: Tensor
    qkv_bias_N: Tensor | None
    keys_GSd: Tensor
    values_GSd: Tensor
    heads: int
    out_DN: Tensor
    out_bias_D: Tensor | None
    qkv_scale_N: Tensor | None = None
    out_scale_D: Tensor | None = None


class MoEWeights(NamedTuple):
    """A MoE layer's routed SwiGLU experts for the one-token calls: an fp32 ``router`` [E, D], its bias [E] or
    None, an fp32 ``selection_bias`` [E] (it picks, it does not weigh), ``top_k`` picks renormalised when
    ``normalize``, times ``route_scale``; ``w_in`` [E, 2F, D] (gate rows first) and ``w_out`` [E, D, F],
    output-major, bf16 or int8 with fp32 scales [E, 2F] and [E, D] (None: bf16)."""

    router_ED: Tensor
    router_bias_E: Tensor | None
    selection_bias_E: Tensor
    top_k: int
    normalize: bool
    route_scale: float
    w_in_END: Tensor
    w_out_EDN: Tensor
    w_in_scale_EN: Tensor | None = None
    w_out_scale_ED: Tensor | None = None


class BlockWeights(NamedTuple):
    """A block of the one-call decode step (``blocks_token_bf16``): its attention half, the RMSNorm (weight
    [D] in bf16, eps) its MoE layer takes the residual stream through, and the MoE layer."""

    attention: AttentionWeights
    norm_D: Tensor
    eps: float
    moe: MoEWeights


def _weight(name: str, w: Tensor, scale: Tensor | None) -> _Weight:
    """A one-token call's weight: bf16 (``scale`` None) or int8 with fp32 per-output scales [..., N]
    (``infer.quant``'s int8), contiguous in CPU memory."""
    if scale is None and w.dtype == torch.bfloat16:
        pass
    elif w.dtype != torch.int8 or scale is None or scale.dtype != torch.float32 or scale.shape != w.shape[:-1]:
        given = f"{w.dtype} {list(w.shape)} and {None if scale is None else list(scale.shape)} scales"
        raise ValueError(f"{name}: a bf16 weight, or int8 with fp32 scales per output, not {given}")
    scales = scale is None or (scale.is_contiguous() and scale.device.type == "cpu")
    if w.device.type != "cpu" or not w.is_contiguous() or not scales:
        raise ValueError(f"{name}: a contiguous weight in CPU memory")
    return _Weight(w.data_ptr(), None if scale is None else scale.data_ptr())


def _address(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _inference(tensors: list[Tensor], name: str) -> None:
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError(f"{name} takes contiguous CPU tensors")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{name} is for inference: it records no gradient")


def _token(x_D: Tensor, name: str) -> int:
    """One token's bf16 activations [D]: D."""
    if x_D.dim() != 1 or x_D.dtype != torch.bfloat16:
        raise ValueError(f"{name} takes one token's bf16 activations [D], not {x_D.dtype} {list(x_D.shape)}")
    _inference([x_D], name)
    return x_D.shape[0]


def _moe_layer(m: MoEWeights, D: int, norm_D: Tensor | None = None, eps: float = 0.0) -> tuple[_MoELayer, Tensor]:
    """``m`` checked for tokens of width ``D`` as decode.c's ``moe_layer``, with the RMSNorm before it (None:
    none); and the buffer its picks land in (``top_k`` int64, then as many fp32 weights)."""
    E, N, D_in = m.w_in_END.shape
    F = N // 2
    if m.w_out_EDN.shape != (E, D, F) or 2 * F != N or D_in != D:
        raise ValueError(
            f"a MoE layer's call takes w_in [E, 2F, {D}] and w_out [E, {D}, F], not {list(m.w_in_END.shape)}"
        )
    w_in, w_out = _weight("w_in", m.w_in_END, m.w_in_scale_EN), _weight("w_out", m.w_out_EDN, m.w_out_scale_ED)
    fp32 = [m.router_ED, m.selection_bias_E, *([] if m.router_bias_E is None else [m.router_bias_E])]
    shapes = m.router_ED.shape == (E, D) and all(t.shape == (E,) for t in fp32[1:])
    if not shapes or any(t.dtype != torch.float32 for t in fp32) or not 0 < m.top_k <= E <= MAX_EXPERTS:
        raise ValueError(
            f"a MoE layer's call takes an fp32 router [{E}, {D}], biases [{E}] and 1 to {E} picks, not {m.top_k}"
        )
    if norm_D is not None and (norm_D.shape != (D,) or norm_D.dtype != torch.bfloat16):
        raise ValueError(f"the MoE layer's RMSNorm takes a bf16 weight [{D}]")
    _inference(fp32 + ([] if norm_D is None else [norm_D]), "moe_token_bf16")
    picks = torch.empty(2 * m.top_k, dtype=torch.int64)  # the picks, then their fp32 weights in the second half
    layer = _MoELayer(_address(norm_D), eps, m.router_ED.data_ptr(), _address(m.router_bias_E))
    layer.selection_bias, layer.experts, layer.hidden, layer.top_k = m.selection_bias_E.data_ptr(), E, F, m.top_k
    layer.normalize, layer.route_scale, layer.w_in, layer.w_out = int(m.normalize), m.route_scale, w_in, w_out
    layer.picked, layer.weights = picks.data_ptr(), picks[m.top_k :].data_ptr()
    return layer, picks


def _moe_scratch(m: MoEWeights, D: int) -> tuple[int, int]:
    """decode.c's ``moe_token``'s scratch: bf16 values, floats."""
    F = m.w_out_EDN.shape[-1]
    return 3 * F + m.top_k * D, D + F


def _attention_layer(a: AttentionWeights, D: int, position: int, rope_d2: Tensor) -> _AttentionLayer:
    """``a`` checked for a token of width ``D`` at ``position`` with this position's ``rope`` [d/2, 2], as
    decode.c's ``attention_layer``."""
    (G, S, d), heads = a.keys_GSd.shape, a.heads
    qkv, out = _weight("qkv", a.qkv_ND, a.qkv_scale_N), _weight("out", a.out_DN, a.out_scale_D)
    biases = [b for b in (a.qkv_bias_N, a.out_bias_D) if b is not None]
    bf16 = [a.norm_D, a.keys_GSd, a.values_GSd, *biases]
    shapes = a.qkv_ND.shape == ((heads + 2 * G) * d, D) and a.out_DN.shape == (D, heads * d)
    shapes &= a.norm_D.shape == (D,) and a.values_GSd.shape == a.keys_GSd.shape
    shapes &= a.qkv_bias_N is None or a.qkv_bias_N.shape == a.qkv_ND.shape[:1]
    shapes &= a.out_bias_D is None or a.out_bias_D.shape == (D,)
    if any(t.dtype != torch.bfloat16 for t in bf16) or not shapes:
        raise ValueError(f"an attention half's call takes bf16 weights for {heads} heads over {G} groups of {d}")
    rope = rope_d2.shape == (d // 2, 2) and rope_d2.dtype == torch.float32 and rope_d2.is_contiguous()
    rope &= rope_d2.device.type == "cpu"
    if heads % G or d % 32 or d > 128 or not 0 <= position < S or not rope:
        raise ValueError(
            f"an attention half's call takes heads of 32 to 128, not {d}, at a cached position: {position}"
        )
    _inference(bf16, "attention_token_bf16")
    layer = _AttentionLayer(a.norm_D.data_ptr(), a.eps, qkv, _address(a.qkv_bias_N))
    layer.keys, layer.values, layer.gs = a.keys_GSd.data_ptr(), a.values_GSd.data_ptr(), S * d
    layer.heads, layer.groups, layer.head_dim = heads, G, d
    layer.out, layer.out_b, layer.scale = out, _address(a.out_bias_D), d**-0.5
    return layer


def _attention_scratch(a: AttentionWeights, D: int, position: int) -> tuple[int, int]:
    """decode.c's ``attention_token``'s scratch: bf16 values, floats."""
    (G, _, d), H = a.keys_GSd.shape, a.heads
    return D + (3 * H + 2 * G) * d, H * (position + 1) + D + H * d


def moe_token_bf16(x_D: Tensor, residual_D: Tensor, m: MoEWeights) -> tuple[Tensor, Tensor]:
    """One token through a MoE layer's routed SwiGLU experts and the residual around it, in one call
    (``decode.c``'s ``moe_token``) with the weights ``m``: fp32 router logits ``x @
    router.t() + bias``, softmax, the ``top_k`` best by score plus ``selection_bias``, renormalised when
    ``normalize``, times ``route_scale``; each picked expert ``silu(gate) * up``; returns ``residual +
    sum_k bf16(w_k) y_k`` [D] and the picked experts [top_k] (ascending). Every product is summed in fp32
    and rounded to bf16, as torch's ops round them. What differs from torch's ops: the order of the fp32
    sums, silu's and the softmax's exp (the C library's; the softmax divides by the sum), and ties between
    scores, which go to the lower index."""
    lib = _library_or_raise()
    D = _token(x_D, "moe_token_bf16")
    if _token(residual_D, "moe_token_bf16") != D:
        raise ValueError(f"moe_token_bf16 takes one token's bf16 x and residual [{D}]")
    layer, picks = _moe_layer(m, D)
    bf16, floats = _moe_scratch(m, D)
    out = torch.empty(D, dtype=torch.bfloat16)
    scratch, widened = torch.empty(bf16, dtype=torch.bfloat16), torch.empty(floats, dtype=torch.float32)
    args = (x_D.data_ptr(), residual_D.data_ptr(), scratch.data_ptr(), widened.data_ptr(), out.data_ptr())
    lib.moekit_moe_token_bf16(torch.get_num_threads(), D, ctypes.byref(layer), *args)
    return out, picks[: m.top_k]


def attention_token_bf16(x_D: Tensor, rope_d2: Tensor, position: int, a: AttentionWeights) -> Tensor:
    """One token through a block's attention half and the residual around it, in one call (``decode.c``'s
    ``attention_token``) with the weights ``a``: ``x + out(attend(rope(qkv(rms_norm(x)))))``
    [D], ``rope`` [d/2, 2] this position's (cos, sin) in fp32, the cache written in place at ``position``
    and attended up to it. Rounded to bf16 where torch's ops round; the products and the attention are
    ``rows_bf16``'s (``rows_int8``'s) and ``one_query_bf16``'s."""
    lib = _library_or_raise()
    D = _token(x_D, "attention_token_bf16")
    layer = _attention_layer(a, D, position, rope_d2)
    bf16, floats = _attention_scratch(a, D, position)
    scratch, scores = torch.empty(bf16, dtype=torch.bfloat16), torch.empty(floats, dtype=torch.float32)
    out = torch.empty(D, dtype=torch.bfloat16)
    args = (rope_d2.data_ptr(), x_D.data_ptr(), scratch.data_ptr(), scores.data_ptr(), out.data_ptr())
    lib.moekit_attention_token_bf16(torch.get_num_threads(), D, position, ctypes.byref(layer), *args)
    return out


def blocks_token_bf16(
    x_D: Tensor, blocks: Sequence[BlockWeights], rope_d2: Tensor, position: int
) -> tuple[Tensor, list[Tensor]]:
    """One token at ``position`` through every block in ``blocks`` (its attention half, then its MoE layer
    on its RMSNorm of the residual stream), in one call (``decode.c``'s
    ``moekit_blocks_token_bf16``): the residual stream after the last block [D] and each MoE layer's picks.
    What ``attention_token_bf16``, ``rms_norm_bf16`` and ``moe_token_bf16`` compute block after block, bit
    for bit, with no Python between them."""
    lib = _library_or_raise()
    D = _token(x_D, "blocks_token_bf16")
    attention, moe = (_AttentionLayer * len(blocks))(), (_MoELayer * len(blocks))()
    picks, bf16, floats = [], 0, 0
    for i, (a, ffn_norm, ffn_eps, m) in enumerate(blocks):
        attention[i] = _attention_layer(a, D, position, rope_d2)
        moe[i], picked = _moe_layer(m, D, ffn_norm, ffn_eps)
        picks.append(picked[: m.top_k])
        scratch = _attention_scratch(a, D, position), _moe_scratch(m, D)
        bf16, floats = max(bf16, *(s[0] for s in scratch)), max(floats, *(s[1] for s in scratch))
    x = x_D.clone()
    scratch, scores = torch.empty(2 * D + bf16, dtype=torch.bfloat16), torch.empty(floats, dtype=torch.float32)
    args = (rope_d2.data_ptr(), x.data_ptr(), scratch.data_ptr(), scores.data_ptr())
    lib.moekit_blocks_token_bf16(torch.get_num_threads(), len(blocks), D, position, attention, moe, *args)
    return x, picks
