"""Imports flow one way: the run directory (checkpoints, manifests, ``load_run``), the tokenizer, the
storage hierarchy (files, regions, slots, loaders: what offloaded inference and offloaded training
both stand on) and the atomic-write and byte-size helpers stand below training, inference and
conversion, which never import one another; serving stands on inference.

Read from the source with ``ast``, so an import inside a function counts as much as one at the top.
What a command line pays at start-up is checked in a fresh interpreter: ``moekit --help`` loads no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import moekit

PACKAGE = Path(moekit.__file__).parent
ABOVE_RUN = ("moekit.train", "moekit.infer", "moekit.serve", "moekit.convert", "moekit.cli")
ABOVE_MODEL = (*ABOVE_RUN, "moekit.run", "moekit.tokenizer")

# Each part of the package (a subpackage or a module file) and the modules it must not import.
RULES = {
    "train": ("moekit.infer", "moekit.serve", "moekit.convert", "moekit.cli"),
    "infer": ("moekit.train", "moekit.serve", "moekit.convert", "moekit.cli"),
    "serve": ("moekit.train", "moekit.convert", "moekit.cli"),
    # offloaded experts, top down: options and model building, the offloader's books, storage moving bytes
    "infer/offloader.py": ("moekit.infer.offload", "moekit.model", "moekit.run"),
    # the storage hierarchy knows no model, no run and nothing of what stands on it
    "storage": (
        *ABOVE_MODEL,
        "moekit.model",
        "moekit.layer",
        "moekit.parallel",
        "moekit.experts",
        "moekit.dispatch",
        "moekit.routing",
        "moekit.config",
        "moekit.runconfig",
    ),
    "convert": ("moekit.train", "moekit.infer", "moekit.serve", "moekit.cli"),
    "run": ABOVE_RUN,
    "tokenizer.py": (*ABOVE_RUN, "moekit.run"),
    "fileio.py": ("moekit",),
    "units.py": ("moekit",),
    "errors.py": ("moekit",),
    "stats.py": ("moekit",),
    "kernels": ("moekit",),  # C kernels and their build: a leaf under the matmuls that call them
    "parallel": ("moekit.train", "moekit.infer", "moekit.convert", "moekit.run", "moekit.cli"),
    "dispatch": ("moekit.parallel", "moekit.train", "moekit.infer", "moekit.convert", "moekit.run", "moekit.cli"),
    "model": (*ABOVE_MODEL, "moekit.parallel"),
    "layer.py": (*ABOVE_MODEL, "moekit.parallel", "moekit.model"),
    "experts": (*ABOVE_MODEL, "moekit.parallel", "moekit.model", "moekit.layer", "moekit.dispatch"),
    "routing.py": (
        *ABOVE_MODEL,
        "moekit.parallel",
        "moekit.model",
        "moekit.layer",
        "moekit.dispatch",
        "moekit.experts",
    ),
}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``: ``from a import b`` gives ``a.b`` (a module or a name
    in ``a``), relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here.rsplit(".", node.level)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("part", sorted(RULES))
def test_imports_flow_one_way(part: str) -> None:
    root = PACKAGE / part
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
    assert root.exists() and files, f"moekit/{part} is missing"
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in files
        for line, module in sorted(imports(path))
        if any(_within(module, banned) for banned in RULES[part])
    ]
    assert not wrong, "\n".join(wrong)


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    named = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}
    return {name.removesuffix(".__init__"): path for name, path in named.items()}


def _module_of(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` (a module, or a name defined in one) lives in; None outside moekit."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_no_module_imports_itself_back() -> None:
    modules = _modules()
    graph = {
        name: sorted({_module_of(m, modules) for _, m in imports(path)} - {None, name})
        for name, path in modules.items()
    }
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every import is explored

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in graph[name]:
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (found := cycle_from(target, [*path, target])):
                return found
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (found := cycle_from(name, [name])):
            raise AssertionError("import cycle: " + " -> ".join(found))


def _loaded_after(code: str) -> set[str]:
    """Modules a fresh interpreter holds after running ``code`` (its own sys.path and environment)."""
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(done.stdout.split())


def test_help_and_the_package_load_no_torch() -> None:
    """``moekit --help`` (and a command's ``--help``) build every parser without torch, which takes seconds
    to import; ``import moekit`` alone loads none of its modules."""
    help_run = "from moekit.cli import build_parser\nbuild_parser().format_help()"
    assert "torch" not in _loaded_after(help_run)
    assert "torch" not in _loaded_after("import moekit")
    assert "moekit.layer" in _loaded_after("from moekit import MoE")  # the public names still load on use


@pytest.mark.slow
def test_a_single_device_layer_loads_no_dtensor() -> None:
    """``torch.distributed.tensor`` (a second of imports) loads only where expert parallelism uses it."""
    assert "torch.distributed.tensor" not in _loaded_after("import moekit.layer, moekit.model")


@pytest.mark.slow
def test_loading_a_model_to_generate_imports_no_compiler(tmp_path: Path) -> None:
    """A model loaded for inference (the command line's error handling, a run built on the meta device
    and allocated, a Hugging Face layout joined on meta for its shape check) imports neither
    ``torch._dynamo`` nor sympy: most ops on meta tensors run torch's Python references, whose first call
    imports them, about a second of every ``moekit generate`` and ``moekit serve`` start."""
    pytest.importorskip("transformers")
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    MixtralForCausalLM(config).save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    code = (
        "import torch, moekit.cli\n"
        "from moekit.parallel.failures import RankFailure\n"
        "from moekit.model_dir import load_for_inference\n"
        f"load_for_inference({str(tmp_path)!r})"
    )
    loaded = _loaded_after(code)
    assert "moekit.model" in loaded and not {"torch._dynamo", "sympy"} & loaded
