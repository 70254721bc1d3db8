"""Pure checks of a tensor-parallel layout: sizes against ``tp``, import paths of plans.

No torch import: a launcher runs these on the config before any rank starts (in milliseconds,
not after torch's import), and :mod:`forge_tp_plans.apply` runs them again on the real model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from forge_core.errors import ForgeConfigError

if TYPE_CHECKING:
    from forge_core.model_config import ModelConfig

__all__ = [
    "check_divides",
    "check_plan_import",
    "check_transformer_tp",
    "default_sequence_parallel",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divides(tp: int, sizes: Mapping[str, int]) -> None:
    """Every named size must split evenly over ``tp`` ranks; the refusal lists the tp that do."""
    for name, size in sizes.items():
        if size % tp:
            choices = _divisors(math.gcd(*sizes.values()))
            raise ForgeConfigError(
                f"tp={tp} does not divide {name}={size}; choose tp in {{{', '.join(map(str, choices))}}}"
            )


def check_transformer_tp(
    config: ModelConfig,
    tp: int,
    *,
    head_sharded: bool = True,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
) -> None:
    """Pure checks of the reference Transformer's sizes against ``tp`` (run before any launch)."""
    sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads}
    if len(config.custom_ffn_layers) < config.n_layers:  # MoE blocks run replicated over tp
        sizes["ffn_dim"] = config.ffn_dim
    if head_sharded:
        sizes["vocab_size"] = config.vocab_size
    check_divides(tp, sizes)
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ForgeConfigError(
            f"sequence length {seq_len} is not divisible by tp={tp}, which sequence parallelism needs; "
            f"choose a multiple of {tp} or sequence_parallel=False"
        )


def check_plan_import(path: str, allow_import: bool | Sequence[str]) -> str:
    """Check that ``"package.module:NAME"`` may be imported; returns the module name (pure check).

    Importing runs the module's code: only ``allow_import=True`` or a module prefix listed in
    ``allow_import`` permits it.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ForgeConfigError(
            f"plan={path!r}: an import path must look like 'package.module:NAME'"
        )
    allowed = allow_import is True or (
        not isinstance(allow_import, bool)
        and any(
            module_name == p or module_name.startswith(p.rstrip(".") + ".") for p in allow_import
        )
    )
    if not allowed:
        raise ForgeConfigError(
            f"plan={path!r}: importing '{module_name}' runs its code, and imports are off by default; "
            "allow it with allow_import=True (Python) or list the module prefix in tp.allow_import (config)"
        )
    return module_name


def default_sequence_parallel(
    *, registered_plan: bool, tied_embeddings: bool, pipeline_stage: bool = False
) -> bool:
    """Whether sequence parallelism is on when nobody asked (``sequence_parallel=None`` /
    ``tp.sequence_parallel = "auto"``): the one rule, for :func:`apply_tensor_parallel` (which
    knows the model) and for forge's layout (which knows the config).

    On for registered plans (forge's own, which place the SequenceParallel entries), off for a
    model whose plan is basic TP (Hugging Face, opt-in attributes), off with tied embeddings (the
    shared weight is vocab-sharded for the embedding and the head; the reference layout keeps
    basic TP there, though ``sequence_parallel=True`` works and is tested), and off on a
    pipeline stage (what passes between stages must be plain tensors).
    """
    return registered_plan and not tied_embeddings and not pipeline_stage
