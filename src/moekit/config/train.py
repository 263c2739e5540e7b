"""What a training run reads (``[data]``) and how it optimises, evaluates, logs and saves (``[train]``)."""

from __future__ import annotations

from dataclasses import dataclass

from moekit.config.fields import (
    NONNEGATIVE,
    NONNEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    check_fields,
    choice,
    option,
    require,
)

TOKENIZERS = ("byte", "char", "bpe")
DTYPES = ("fp32", "bf16")


@dataclass
class DataConfig:
    """Where training text comes from and how it becomes tokens."""

    path: str | None = option(None, "text file, directory or glob; None: this Python's standard library source")
    tokenizer: str = option(
        "byte", "byte (no training) | char (corpus alphabet) | bpe (trained on the corpus)", choice(*TOKENIZERS)
    )
    bpe_vocab_size: int = option(4096, "vocabulary size when tokenizer = bpe")
    val_fraction: float = option(0.1, "share of tokens (the tail of the corpus) held out for validation")
    cache_dir: str | None = option(None, "token cache; None: ~/.cache/moekit/tokens")

    def __post_init__(self) -> None:
        check_fields(self, "data.")
        require(self.bpe_vocab_size >= 260, "data.bpe_vocab_size", self.bpe_vocab_size, "must be >= 260")
        require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")


@dataclass
class TrainConfig:
    """The optimisation loop, evaluation, logging and checkpoints."""

    steps: int = option(300, "optimizer steps", POSITIVE_INT)
    batch_size: int = option(16, "sequences per micro-batch", POSITIVE_INT)
    grad_accum: int = option(1, "micro-batches per optimizer step", POSITIVE_INT)
    lr: float = option(1e-3, "peak learning rate (AdamW)", POSITIVE)
    min_lr: float = option(1e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = option(30, "linear warmup from 0 to lr", NONNEGATIVE_INT)
    weight_decay: float = option(
        0.1, "AdamW decay on weights by role: not on biases (expert ones included), norms or sinks"
    )
    beta1: float = option(0.9, "AdamW first-moment decay")
    beta2: float = option(0.95, "AdamW second-moment decay")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0 = off", NONNEGATIVE)
    max_nonfinite_steps: int = option(
        3, "stop after this many consecutive steps skipped for a NaN/inf gradient norm", POSITIVE_INT
    )
    dtype: str = option("fp32", "fp32, or bf16 autocast (fp32 master weights, router kept in fp32)", choice(*DTYPES))
    compile: bool = option(False, "torch.compile each block (MoE dispatch stays eager)")
    seed: int = option(1337, "seeds init, data order and dropout: equal seeds give equal runs on CPU")
    eval_every: int = option(50, "steps between validation passes (and one at the end)", POSITIVE_INT)
    eval_iters: int = option(10, "validation batches per pass", POSITIVE_INT)
    ckpt_every: int = option(
        100, "steps between checkpoints (and one at the end); 0 = only at the end", NONNEGATIVE_INT
    )
    keep_checkpoints: int = option(2, "newest checkpoints kept on disk", POSITIVE_INT)
    async_checkpoint: bool = option(False, "write checkpoints on a background thread while training goes on")
    peak_tflops: float | None = option(
        None, "device peak for MFU; None: a known GPU's dense peak in train.dtype, 0.5 on a CPU", POSITIVE
    )
    sample_tokens: int = option(200, "tokens generated into sample.txt at the end; 0 = none", NONNEGATIVE_INT)
    # Training beyond memory: MoE experts' weights and AdamW state kept on disk, a budgeted working set in RAM.
    memory_budget: str = option("", 'RAM for the experts\' working set (e.g. 4GB); "" = every expert stays in memory')
    host_budget: str = option(
        "", 'RAM holding the offloaded expert state moved most per step instead of the disk; "" = none'
    )
    offload_dir: str = option("", 'directory of the offloaded expert state (a local disk); "" = <run_dir>/offload')

    def __post_init__(self) -> None:
        check_fields(self, "train.")
        require(0 <= self.min_lr <= self.lr, "train.min_lr", self.min_lr, f"must be in [0, lr={self.lr}]")
        self._check_offload()

    def _check_offload(self) -> None:
        from moekit.units import parse_bytes

        for name in ("memory_budget", "host_budget"):
            size = getattr(self, name)
            if size:  # "" = none
                require(parse_bytes(size, f"train.{name}") > 0, f"train.{name}", size, "must be > 0")
        if self.host_budget:
            require(
                bool(self.memory_budget),
                "train.host_budget",
                self.host_budget,
                "needs train.memory_budget (the host tier sits between the working set and the disk)",
            )
        require(
            not self.offload_dir or bool(self.memory_budget),
            "train.offload_dir",
            self.offload_dir,
            "needs train.memory_budget (nothing is offloaded without a budget)",
        )

    @property
    def offloaded(self) -> bool:
        """Whether the experts train beyond memory (``memory_budget`` given)."""
        return bool(self.memory_budget)
