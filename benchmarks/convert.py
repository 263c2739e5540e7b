"""Conversion and offloaded generation at real size: a >= 6 GB bf16 Mixtral checkpoint in 5+ shards.

    python benchmarks/convert.py [--json] [--repeats 3] [--layers 9] [--expert-budget 1GB] [--new-tokens 16]

``--layers 1`` is the reduced size (one block: 1.0 GB), for a quick run.

Builds once (cached under --root) a Mixtral checkpoint of random bf16 weights with transformers, shard
by shard, never the whole model in memory: the model is made on the meta device, its state dict split
into shards by ``huggingface_hub``, and each shard's tensors are drawn, turned back into the checkpoint's
names by transformers' own ``revert_weight_conversion``, saved and freed. Default shape: Mixtral's
attention and router at d_model 2048 (16 heads, 4 key/value heads), 8 experts of width 7168, top-2,
a 32000-word vocabulary, 9 layers: 6.8 GB. Then, each in a child process through the real CLI:

  convert    python -m moekit convert HF --out RUN                 wall time, bytes written, peak RSS
  generate   python -m moekit generate RUN --memory-budget B ...   tokens/s (the CLI's own), peak RSS
  gen-hf     python -m moekit generate HF --memory-budget B ...    the same, experts read in place from the
                                                                   Hugging Face shards (no converted copy),
                                                                   shards evicted from the page cache first
  reads      in this process: a sample of experts read cold from the shards, by plain pread of their exact
             ranges (what gen-hf does) and by O_DIRECT reads of the 4 KiB-aligned supersets plus the copy
             that puts each matrix in place; GB/s, interleaved round by round

B is the converted checkpoint's non-expert weights plus --expert-budget (the same B for gen-hf). Peak RSS is
the operating system's: the child's ``VmHWM`` (/proc/PID/status), polled until it exits. Targets: convert under 2.5 GB;
generate under expert budget + non-expert weights + 1 GB. The weights are random, so the routers
spread tokens evenly: a worst case for the expert cache (the hit rate is printed). The shard files may
sit in the page cache from the build (the kernel's, not the converter's memory; generation reads
experts with O_DIRECT). Prints a table; with ``--json`` one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _spread import show, spread  # noqa: E402

VOCAB = 32000


def _config(layers: int):
    import transformers as tf

    return tf.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=2048,
        intermediate_size=7168,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,  # the KV cache is preallocated at this length
        sliding_window=None,
        tie_word_embeddings=False,
    )


def build_checkpoint(directory: Path, layers: int, shard_size: str) -> None:
    """A Mixtral checkpoint of random bf16 weights, written one shard at a time (one shard in memory)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = _config(layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = model.state_dict()
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=shard_size
    )
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for file, names in split.filename_to_tensors.items():
        tensors = {}
        for name in names:
            shape = state[name].shape
            if "norm" in name:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = (0.02 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
        tensors = revert_weight_conversion(model, tensors)
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        del tensors
    index = {"metadata": {"total_size": split.metadata["total_size"]}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(tmp)
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp / "tokenizer.json"))
    tmp.rename(directory)


def _high_water(pid: int) -> int:
    """``VmHWM`` of a running process (its peak resident set, in bytes), or 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(match[1]) * 1024 if match else 0


def run_child(argv: list[str]) -> dict:
    """Run ``argv``; its wall time, its peak RSS as the OS counts it, exit code and output.

    NOTE: ``VmHWM`` polled until exit, not ``ru_maxrss``: Linux starts a child's ``ru_maxrss`` at the
    high-water mark of the process that forked it (recorded at exec), so a parent that once held a
    large checkpoint would show in every child's figure. ``VmHWM`` is the exec'd process's own.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _high_water(proc.pid))
            time.sleep(0.05)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        result = {"wall_s": wall, "peak_rss": peak, "rc": proc.returncode}
        result |= {"stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")}
    if result["rc"] != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result['rc']}):\n{result['stderr'][-3000:]}")
    return result


def read_speeds(hf: Path, experts: int, rounds: int) -> dict[str, list[float]]:
    """GB/s of cold reads of ``experts`` experts from the shards: plain pread of each matrix's exact range
    into the slot (``RangeStore``), against O_DIRECT reads of each range's 4 KiB-aligned superset into a
    scratch buffer and the copy into the slot that a direct read of an unaligned range needs."""
    import os

    from moekit.convert.in_place import expert_ranges
    from moekit.convert.stream import open_hf
    from moekit.infer.range_store import RangeStore
    from moekit.storage.aligned import aligned_empty

    ranges = expert_ranges(open_hf(hf))
    keys = sorted(ranges)[:: max(1, len(ranges) // experts)][:experts]
    speeds: dict[str, list[float]] = {"pread": [], "direct": []}
    with RangeStore({k: ranges[k] for k in keys}) as store:
        slot = aligned_empty(store.slot_bytes)
        scratch = aligned_empty(store.slot_bytes + 4096 * 4)
        files = {p.path for key in keys for p in store.pieces[key]}
        fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in files}
        try:
            for _ in range(rounds):
                store.drop_page_cache()
                started = time.perf_counter()
                for key in keys:
                    store.read_into(key, slot)
                speeds["pread"].append(len(keys) * store.bytes_per_expert / (time.perf_counter() - started) / 1e9)
                store.drop_page_cache()
                started = time.perf_counter()
                for key in keys:
                    for p in store.pieces[key]:
                        skew = p.file_offset % 4096
                        length = (skew + p.nbytes + 4095) // 4096 * 4096
                        os.preadv(fds[p.path], [memoryview(scratch[:length].numpy())], p.file_offset - skew)
                        slot[p.slot_offset : p.slot_offset + p.nbytes].copy_(scratch[skew : skew + p.nbytes])
                speeds["direct"].append(len(keys) * store.bytes_per_expert / (time.perf_counter() - started) / 1e9)
        finally:
            for fd in fds.values():
                os.close(fd)
    return speeds


def non_expert_bytes(weights: Path) -> int:
    from moekit.run.safetensors_io import read_header

    return sum(e.end - e.begin for name, e in read_header(weights).items() if ".ffn.experts." not in name)


def _drop_pages(files: list[Path]) -> None:
    """Evict ``files`` from the OS page cache (convert has just read them)."""
    import os

    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _generate(argv: list[str]) -> dict:
    """A ``moekit generate`` child: its wall time, peak RSS and the tokens/s, hit rate and bytes it reports."""
    gen = run_child(argv)
    speed = re.search(r"([0-9.]+) tokens/s, expert cache hit rate ([0-9.]+)%, read ([0-9.]+ \w?B)", gen["stderr"])
    assert speed, gen["stderr"][-2000:]
    return gen | {"tokens_per_s": float(speed[1]), "hit_rate": float(speed[2]) / 100, "read": speed[3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/convbench"), help="where the checkpoints go")
    parser.add_argument("--layers", type=int, default=9, help="Mixtral blocks (9: 6.8 GB in bf16)")
    parser.add_argument("--shard-size", default="1.5GB", help="Hugging Face shard size (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="conversions and generations, each")
    parser.add_argument("--expert-budget", default="1GB", help="expert cache beside the non-expert weights")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per generation")
    parser.add_argument("--read-experts", type=int, default=16, help="experts per round of the reads row")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from moekit.units import parse_bytes

    hf = args.root / f"hf-mixtral-{args.layers}l"
    if not hf.is_dir():
        started = time.perf_counter()
        build_checkpoint(hf, args.layers, args.shard_size)
        print(f"built {hf} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    shards = sorted(hf.glob("model-*.safetensors"))
    hf_bytes = sum(p.stat().st_size for p in shards)
    moekit = [sys.executable, "-m", "moekit"]
    run = args.root / "run"
    convert, generate, generate_hf = [], [], []
    for _ in range(args.repeats):  # round by round: one conversion, then one generation from it
        shutil.rmtree(run, ignore_errors=True)
        convert.append(run_child([*moekit, "convert", str(hf), "--out", str(run)]))
        weights = next(run.glob("checkpoints/step_*/model.safetensors"))
        written = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
        convert[-1] |= {"bytes_written": written}
        resident = non_expert_bytes(weights)
        budget = resident + parse_bytes(args.expert_budget, "--expert-budget")
        prompt = " ".join(f"w{i}" for i in range(1, 17))
        argv = [*moekit, "generate", str(run), "--device", "cpu", "--memory-budget", str(budget)]
        argv += ["--temperature", "0", "--max-new-tokens", str(args.new_tokens), "--prompt", prompt]
        generate.append(_generate(argv) | {"budget": budget, "non_expert": resident})
        argv[4] = str(hf)  # the same generation, its experts read in place from the Hugging Face shards
        _drop_pages(shards)  # cold, as the converted run's O_DIRECT reads are
        generate_hf.append(_generate(argv))
        assert generate_hf[-1]["stdout"] == generate[-1]["stdout"], "the same greedy tokens"
    shutil.rmtree(run, ignore_errors=True)

    gb = 1e9
    expert_budget = parse_bytes(args.expert_budget, "--expert-budget")
    gen_target = expert_budget + generate[0]["non_expert"] + gb
    largest = max(p.stat().st_size for p in shards)
    print(
        f"checkpoint: {hf_bytes / gb:.2f} GB bf16 in {len(shards)} shards (largest {largest / gb:.2f} GB); "
        f"{args.repeats} runs, median (min .. max)"
    )
    print(f"{'step':<9} {'wall s':>22} {'peak RSS GB':>22} {'target GB':>10} {'other':<40}")
    written = [c["bytes_written"] / gb for c in convert]
    print(
        f"{'convert':<9} {show([c['wall_s'] for c in convert], '.1f'):>22} "
        f"{show([c['peak_rss'] / gb for c in convert], '.2f'):>22} {2.5:>10.2f} written {show(written, '.2f')} GB"
    )
    print(
        f"{'generate':<9} {show([g['wall_s'] for g in generate], '.1f'):>22} "
        f"{show([g['peak_rss'] / gb for g in generate], '.2f'):>22} {gen_target / gb:>10.2f} "
        f"{show([g['tokens_per_s'] for g in generate], '.2f')} tokens/s, "
        f"hit rate {show([g['hit_rate'] for g in generate], '.2f')}"
    )
    print(
        f"{'gen-hf':<9} {show([g['wall_s'] for g in generate_hf], '.1f'):>22} "
        f"{show([g['peak_rss'] / gb for g in generate_hf], '.2f'):>22} {gen_target / gb:>10.2f} "
        f"{show([g['tokens_per_s'] for g in generate_hf], '.2f')} tokens/s, "
        f"hit rate {show([g['hit_rate'] for g in generate_hf], '.2f')}"
    )
    reads = read_speeds(hf, args.read_experts, args.repeats)
    print(
        f"reads: {args.read_experts} experts cold from the shards, GB/s: plain pread {show(reads['pread'], '.2f')}, "
        f"O_DIRECT aligned superset + copy {show(reads['direct'], '.2f')}"
    )
    print(
        f"generate: --memory-budget {generate[0]['budget'] / gb:.2f} GB = non-expert "
        f"{generate[0]['non_expert'] / gb:.2f} GB + experts {args.expert_budget}; {args.new_tokens} greedy tokens "
        f"after a 16-token prompt; read {generate[0]['read']}"
    )
    if args.json:
        keep = ("wall_s", "peak_rss")
        result = {
            "checkpoint": {"bytes": hf_bytes, "shards": len(shards), "layers": args.layers, "dtype": "bf16"},
            "convert": {k: spread([c[k] for c in convert]) for k in (*keep, "bytes_written")},
            "generate": {k: spread([g[k] for g in generate]) for k in (*keep, "tokens_per_s", "hit_rate")},
            "generate_hf": {k: spread([g[k] for g in generate_hf]) for k in (*keep, "tokens_per_s", "hit_rate")},
            "reads_gb_per_s": {k: spread(v) for k, v in reads.items()},
            "targets": {"convert_peak_rss": 2.5 * gb, "generate_peak_rss": gen_target},
            "budget": generate[0]["budget"],
            "new_tokens": args.new_tokens,
        }
        json.dump(result, sys.stdout)
        print()


if __name__ == "__main__":
    main()
