"""``moekit.kernels``: the row kernel against float64 sums written out here, and its build: cached per
source and compiler, refused with the compiler's own words, absent where it cannot run.

Tolerance: the kernel sums in fp32 and rounds to bf16 once, so a result is within half a bf16 unit of
the exact sum (2^-8 of it, relative) plus fp32's accumulated error (K units of 2^-24 of ``|x| @ |w|``);
sums of small integers are exact in fp32, so there the result must be the exact sum rounded to bf16
(to nearest, ties to even).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from moekit import kernels
from moekit.kernels import FLAGS, build, rows_available, rows_bf16, rows_unavailable_reason

needs_rows = pytest.mark.skipif(
    not rows_available(), reason=f"the row kernel does not run here: {rows_unavailable_reason()}"
)
COMPILER = os.environ.get("CC", "cc")
HAS_COMPILER = shutil.which(COMPILER.split()[0]) is not None
can_build = pytest.mark.skipif(
    not rows_available(), reason=f"the row kernel was not built: {rows_unavailable_reason()}"
)


@pytest.mark.skipif(bool(kernels.cpu_lacks()) or not HAS_COMPILER, reason="no AVX512-BF16 CPU with a C compiler")
def test_the_kernel_runs_where_it_can() -> None:
    """On a CPU with AVX512-BF16 and a compiler, a failed build is a failure, not a skipped test; the
    build lands in the test run's own cache directory (tests/conftest.py), not the user's."""
    assert rows_available(), rows_unavailable_reason()
    assert len(list((Path(os.environ["MOEKIT_CACHE"]) / "kernels").glob("decode-*.so"))) == 1


@needs_rows
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("M", "N", "K"), [(1, 1, 1), (1, 37, 70), (2, 130, 1024), (3, 5, 33), (5, 64, 32), (1, 4, 31)])
def test_rows_equal_the_exact_sums_rounded(M: int, N: int, K: int, threads: int) -> None:
    """Random bf16 rows and weights: within the bound above; integer ones (sums exact in fp32, of any
    size up to 2^24): the exact sum rounded to bf16, bit for bit. Row counts past two and odd weight
    widths take the kernel's remainder paths; three threads split 130 rows unevenly."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
        x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
        exact = x.double() @ w.double().t()
        bound = 2.0**-8 * exact.abs() + K * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
        assert bool(((rows_bf16(x, w).double() - exact).abs() <= bound).all())
        xi = torch.randint(-40, 41, (M, K), generator=g).bfloat16()  # |sum| < 40 * 40 * 1024 < 2^24
        wi = torch.randint(-40, 41, (N, K), generator=g).bfloat16()
        assert torch.equal(rows_bf16(xi, wi), (xi.double() @ wi.double().t()).bfloat16())
    finally:
        torch.set_num_threads(before)


@needs_rows
def test_a_nan_or_inf_reaches_only_its_own_row() -> None:
    x, w = torch.ones(3, 40, dtype=torch.bfloat16), torch.ones(6, 40, dtype=torch.bfloat16)
    x[1, 7], x[2, 39] = float("nan"), float("inf")
    y = rows_bf16(x, w)
    assert bool((y[0] == 40).all()) and bool(y[1].isnan().all()) and bool((y[2] == float("inf")).all())


@needs_rows
def test_what_the_kernel_refuses() -> None:
    w = torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bf16 rows \[M, K\] and a bf16 weight \[N, K\], not torch.float32"):
        rows_bf16(torch.ones(1, 8), w)
    with pytest.raises(ValueError, match="not torch.bfloat16 \\[1, 9\\]"):
        rows_bf16(torch.ones(1, 9, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="contiguous weight"):
        rows_bf16(torch.ones(1, 4, dtype=torch.bfloat16), w.t())
    with pytest.raises(RuntimeError, match="records no gradient"):
        rows_bf16(torch.ones(1, 8, dtype=torch.bfloat16, requires_grad=True), w)


@can_build
def test_a_build_is_kept_per_source_and_compiler(tmp_path: Path) -> None:
    """Built once, then found: the same file, untouched, readable by others; another compiler command
    builds its own file, and so does an edited source (the digest covers both)."""
    first = build(kernels.SOURCE, tmp_path, COMPILER)
    stamp = first.stat().st_mtime_ns
    assert build(kernels.SOURCE, tmp_path, COMPILER) == first and first.stat().st_mtime_ns == stamp
    assert first.stat().st_mode & 0o055 == 0o055 & ~_umask(), "group and others may read and load it"
    other = build(kernels.SOURCE, tmp_path, f"{COMPILER} -g0")
    edited = tmp_path / "src" / "decode.c"
    edited.parent.mkdir()
    edited.write_text(kernels.SOURCE.read_text() + "\n/* edited */\n")
    third = build(edited, tmp_path, COMPILER)
    assert len({first, other, third}) == 3 and other.exists() and third.exists()
    built = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert built == sorted([first.name, other.name, third.name]), "no partial file left"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@can_build
def test_build_failures_name_the_compiler_and_its_error(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="no-such-compiler-here: No such file"):
        build(kernels.SOURCE, tmp_path, "no-such-compiler-here")
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return undeclared; }\n")
    with pytest.raises(OSError, match="could not build broken.c: .*undeclared"):
        build(broken, tmp_path / "out", COMPILER)
    assert not any((tmp_path / "out").iterdir()), "a failed build leaves no file behind"


def test_without_the_kernel_the_row_layout_falls_back_to_onednn(tmp_path: Path) -> None:
    """A process whose compiler is missing: the kernels say why, and a batch-1 load keeps oneDNN's packed
    layout (run in a child, as the library is found once per process)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from moekit import kernels, runconfig\n"
        "from moekit.model import Transformer\n"
        "from moekit.infer.resident_experts import prepack_\n"
        "print(kernels.rows_available(), kernels.rows_unavailable_reason())\n"
        "cfg = runconfig.resolve('tiny', {'model.n_layers': '1'})\n"
        "model = prepack_(Transformer(cfg.model, cfg.moe).bfloat16().eval(), few_rows=True)\n"
        "print(type(model.moe_layers()[0].experts).__name__)\n"
    )
    env = {**os.environ, "CC": "no-such-compiler-here", "MOEKIT_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    availability, experts = out.strip().splitlines()
    lacks = kernels.cpu_lacks()
    why = f"this CPU lacks {', '.join(lacks)}" if lacks else "no-such-compiler-here: No such file or directory"
    assert availability == f"False {why}"
    from moekit.experts.matmul import prepackable

    packs = prepackable(torch.empty(1, dtype=torch.bfloat16))
    assert experts == ("PackedExperts" if packs else "GroupedExperts")


def test_the_flags_name_what_the_kernel_needs() -> None:
    """The build asks for exactly the instruction sets the source checks for at run time (and OpenMP)."""
    source = kernels.SOURCE.read_text()
    for isa in ("avx512f", "avx512bw", "avx512vl", "avx512bf16"):
        assert f"-m{isa}" in FLAGS and f'__builtin_cpu_supports("{isa}")' in source
    assert "-fopenmp" in FLAGS
