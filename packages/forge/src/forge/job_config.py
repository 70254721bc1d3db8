"""The job's own config sections: ``[training]``, ``[data]`` and ``[checkpoint]``.

The layers' sections live in their layers; :mod:`forge.config` composes them all into one
``ForgeConfig``. Pure Python, no torch import: a bad value fails before any rank starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from forge_core.errors import (
    MAX_SIZE,
    ForgeConfigError,
    check_field_types,
    check_int,
    check_number,
    did_you_mean,
)

__all__ = [
    "COMPILE_SCOPES",
    "MAX_SEED",
    "TOKEN_DTYPES",
    "CheckpointConfig",
    "DATA_MODES",
    "DataConfig",
    "MetricsConfig",
    "TEXT_SUFFIXES",
    "TrainingConfig",
    "eos_id_problems",
    "is_text_data",
]


#: Where ``torch.compile`` applies (``training.compile_scope``, ``ParallelPlan.compile_scope``).
COMPILE_SCOPES = ("blocks", "model")


#: The largest ``training.seed``: 2**32 - 1. NOTE: seeds reach torch.manual_seed, which takes
#: at most 2**64 - 1, combined with step numbers ((seed + k) x 1_000_003 + step); a 32-bit seed
#: (NumPy's range too) keeps every combination inside it.
MAX_SEED = 2**32 - 1
_SEED_WHY = "a 32-bit seed: forge derives torch.manual_seed's 64-bit seeds from it per step"


#: ``training.optimizer_impl``'s values (torch.optim's implementations of AdamW).
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")


@dataclass(frozen=True)
class TrainingConfig:
    """The short training job that ``forge build`` runs and checks for parity.

    ``param_dtype`` is FSDP2's compute dtype (master weights stay float32); parity tolerances
    are the strict fp32 ones only for ``float32``.
    """

    steps: int = 5
    global_batch_size: int = 8
    seq_len: int = 32
    grad_accum: int = 1
    lr: float = 1e-3
    seed: int = 0
    param_dtype: str = "float32"
    ac_mode: str = "none"
    compile: bool = False
    #: with ``compile``: ``"blocks"`` compiles each block before FSDP2 (inside
    #: ``ParallelPlan.parallelize``), ``"model"`` the whole sharded model (``maybe_compile``).
    compile_scope: str = "blocks"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # forge train only (forge build trains at a constant lr, without clipping):
    #: linear warmup steps, then cosine decay to ``lr * min_lr_ratio`` at ``steps``.
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    #: clip the global gradient norm (over every shard and mesh) to this; 0 turns clipping off.
    max_grad_norm: float = 1.0
    #: AdamW's implementation, torch's names: "auto" (fused on a GPU, torch's default
    #: elsewhere), "for-loop", "foreach" or "fused" (one pass over the state per step).
    optimizer_impl: str = "auto"
    #: where ``forge train`` writes ``metrics.jsonl`` (and ``checkpoints/`` unless checkpoint.dir).
    out_dir: str = "runs/forge"
    log_every: int = 1

    def __post_init__(self) -> None:
        check_field_types(self, "training")
        for name in ("steps", "global_batch_size", "seq_len", "grad_accum", "log_every"):
            check_int(f"training.{name}", getattr(self, name))
        check_int("training.warmup_steps", self.warmup_steps, 0)
        check_int("training.seed", self.seed, 0, MAX_SEED, why=_SEED_WHY)
        tokens = self.global_batch_size * (self.seq_len + 1)
        if tokens > MAX_SIZE:
            raise ForgeConfigError(
                f"training.global_batch_size={self.global_batch_size} x (training.seq_len + 1) "
                f"= {tokens} tokens per step, more than 2**31 - 1: a step's token ids are one "
                "tensor (made whole on every rank for synthetic data); lower them"
            )
        if self.param_dtype not in ("float32", "bfloat16", "float16"):
            raise ForgeConfigError(
                f"training.param_dtype={self.param_dtype!r}: choose float32, bfloat16 or float16"
            )
        if self.compile_scope not in COMPILE_SCOPES:
            raise ForgeConfigError(
                f"training.compile_scope={self.compile_scope!r} is invalid: choose one of "
                f"{list(COMPILE_SCOPES)}" + did_you_mean(str(self.compile_scope), COMPILE_SCOPES)
            )
        self._check_optimizer_numbers()

    def _check_optimizer_numbers(self) -> None:
        """The learning rate, its schedule, weight decay and clipping: finite, in range."""
        check_number("training.lr", self.lr, 0, lo_open=True)
        check_number(
            "training.min_lr_ratio",
            self.min_lr_ratio,
            0,
            1,
            why="the cosine schedule ends at lr x min_lr_ratio",
        )
        check_number("training.max_grad_norm", self.max_grad_norm, 0, why="0 turns clipping off")
        check_number("training.weight_decay", self.weight_decay, 0)
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ForgeConfigError(
                f"training.optimizer_impl={self.optimizer_impl!r} is invalid: choose one of "
                f"{list(OPTIMIZER_IMPLS)}" + did_you_mean(str(self.optimizer_impl), OPTIMIZER_IMPLS)
            )
        if self.lr * self.weight_decay > 1:
            raise ForgeConfigError(
                f"training.weight_decay={self.weight_decay} with training.lr={self.lr}: AdamW "
                "multiplies every weight by 1 - lr x weight_decay each step, so lr x "
                "weight_decay must be at most 1; lower weight_decay (0.1 is usual) or lr"
            )


TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")


#: Suffix of a text ``data.path`` -> the ``datasets`` builder that reads it
#: (:mod:`forge.text_data`); any other file is a flat token file.
TEXT_SUFFIXES: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}


def is_text_data(path: str) -> bool:
    """Whether ``data.path`` is text to tokenize (a suffix of :data:`TEXT_SUFFIXES` or a
    directory saved by ``datasets``), not a flat token file. Here, without torch, so that the
    pure checks can tell them apart before launch."""
    return os.path.isdir(path) or os.path.splitext(path)[1].lower() in TEXT_SUFFIXES


#: What ``data.mode`` trains on: whole documents (``pretrain``) or conversations (``sft``).
DATA_MODES = ("pretrain", "sft")


@dataclass(frozen=True)
class DataConfig:
    """Training data for ``forge train``: ``[data]`` section.

    ``path``: a flat binary file of token ids (no header) in ``dtype``, memory-mapped and read
    in windows of ``training.seq_len + 1`` tokens, each data-parallel rank reading only its own
    samples; or text to tokenize (:mod:`forge.text_data`): a ``.jsonl``/``.json``, ``.parquet``
    or ``.txt`` file, or a directory saved by ``datasets``' ``save_to_disk``. None trains on
    synthetic tokens (learnable bigram sequences, see ``forge_core.training.synthetic_tokens``).
    Windows are visited in a seeded shuffled order, reshuffled every pass over the data.

    Text only: ``tokenizer`` (a directory; default the model's, ``model.hf``), ``mode``
    (``"pretrain"``: documents from ``text_field`` packed with EOS between them;
    ``"sft"``: conversations from ``messages_field`` through the tokenizer's chat template,
    the loss on assistant tokens only), ``packing`` (sft: pack conversations into rows, or one
    per row padded), ``cache_dir`` (tokenized data, keyed by the file's contents and the
    tokenizer; default ``<training.out_dir>/token_cache``) and ``validation_fraction`` (the
    share of documents held out for the validation loss, ``[metrics] validation_every``).

    Token file only: ``eos_id``, the id that ends each document in the file. Set, a row's
    positions restart at 0 after each such token and the loss skips the target that starts a
    document, as for packed text: attention stays inside each document.
    """

    path: str | None = None
    dtype: str = "uint16"
    tokenizer: str | None = None
    mode: str = "pretrain"
    text_field: str = "text"
    messages_field: str = "messages"
    packing: bool = True
    cache_dir: str | None = None
    validation_fraction: float = 0.0
    eos_id: int | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "data")
        if self.eos_id is not None:
            check_int("data.eos_id", self.eos_id, 0)
        if self.dtype not in TOKEN_DTYPES:
            raise ForgeConfigError(
                f"data.dtype={self.dtype!r} is invalid: choose one of {list(TOKEN_DTYPES)}"
                + did_you_mean(str(self.dtype), TOKEN_DTYPES)
            )
        for name in ("path", "tokenizer", "cache_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ForgeConfigError(f"data.{name}={value!r} must be a path (a string)")
        if self.mode not in DATA_MODES:
            raise ForgeConfigError(
                f"data.mode={self.mode!r} is invalid: choose one of {list(DATA_MODES)}"
                + did_you_mean(str(self.mode), DATA_MODES)
            )
        for name in ("text_field", "messages_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ForgeConfigError(f"data.{name} must name a column (a non-empty string)")
        check_number(
            "data.validation_fraction",
            self.validation_fraction,
            0,
            1,
            hi_open=True,
            why="the share of documents held out for the validation loss",
        )

    @property
    def packs_documents(self) -> bool:
        """Whether rows hold several documents, each token's position counted from its own
        document's start: text, or a token file with ``eos_id``."""
        return self.path is not None and (is_text_data(self.path) or self.eos_id is not None)


def eos_id_problems(data: DataConfig, vocab_size: int) -> list[str]:
    """What is wrong with ``data.eos_id`` against the rest of ``[data]`` and the model's
    vocabulary (pure; empty: fine or unset)."""
    eos = data.eos_id
    if eos is None:
        return []
    if data.path is None:
        return [
            f"data.eos_id={eos} marks the documents of a token file, and data.path is unset "
            "(synthetic tokens); set data.path to a token file or unset data.eos_id"
        ]
    if is_text_data(data.path):
        return [
            f"data.eos_id={eos} with text data.path={data.path!r}: the tokenizer's own EOS "
            "ends each document of text; unset data.eos_id"
        ]
    if eos >= vocab_size:
        return [
            f"data.eos_id={eos} is outside model.vocab_size={vocab_size}; set data.eos_id to "
            "the id that ends each document in the token file"
        ]
    return []


@dataclass(frozen=True)
class MetricsConfig:
    """What ``forge train`` records besides ``metrics.jsonl``: ``[metrics]`` section.

    ``tensorboard``: TensorBoard event files in ``<training.out_dir>/tensorboard`` (needs the
    ``tensorboard`` package: ``forge[metrics]``). ``validation_every``: a validation loss every N
    steps (0: never) over ``validation_batches`` global batches of the held-out documents
    (``data.validation_fraction``). ``profile_step``: run step N (1-based; 0: none) under
    ``torch.profiler`` and write each rank's operator tables and Chrome trace to
    ``<training.out_dir>/profile/`` (:mod:`forge.profiling`).
    """

    tensorboard: bool = False
    validation_every: int = 0
    validation_batches: int = 1
    profile_step: int = 0

    def __post_init__(self) -> None:
        check_field_types(self, "metrics")
        check_int("metrics.validation_every", self.validation_every, 0)
        check_int("metrics.validation_batches", self.validation_batches)
        check_int("metrics.profile_step", self.profile_step, 0)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of ``forge train`` (torch.distributed.checkpoint): ``[checkpoint]`` section.

    ``dir``: where ``step-N`` checkpoints go (None: ``<training.out_dir>/checkpoints``).
    ``every``: save every N steps (0: only at the end and on SIGTERM/Ctrl-C). ``keep``: how many
    of the newest checkpoints to keep. ``async_save``: write in the background while training
    goes on. ``resume``: ``"latest"`` continues from the newest checkpoint in ``dir`` if there is
    one, ``"none"`` starts fresh, anything else is the path of a ``step-N`` directory.
    ``verify``: check the checkpoint's files against its manifest before loading it (one read
    of every file; forge's launcher verifies before starting ranks and turns it off for them).
    ``export_hf``: after every checkpoint, also write its model as a Hugging Face directory
    ``<training.out_dir>/hf/step-N`` (``forge export --format hf``; kept, not pruned by
    ``keep``).
    """

    dir: str | None = None
    every: int = 0
    keep: int = 2
    async_save: bool = False
    resume: str = "latest"
    save_at_end: bool = True
    verify: bool = True
    export_hf: bool = False

    def __post_init__(self) -> None:
        check_field_types(self, "checkpoint")
        check_int("checkpoint.every", self.every, 0)
        check_int("checkpoint.keep", self.keep)
        if not isinstance(self.resume, str) or not self.resume:
            raise ForgeConfigError(
                f"checkpoint.resume={self.resume!r}: use 'latest', 'none' or a checkpoint path"
            )
