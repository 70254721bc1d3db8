"""Pure checks of a tensor-parallel layout: sizes against ``tp``, import paths of plans.

No torch import: a launcher runs these on the config before any rank starts (in milliseconds,
not after torch's import), and :mod:`forge_tp_plans.apply` runs them again on the real model.
The ``*_problems`` functions return every problem as a one-line message (empty: fine); the
``check_*`` of the same rule raise the first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from forge_core.errors import refuse

if TYPE_CHECKING:
    from forge_core.model_config import ModelConfig

__all__ = [
    "check_divides",
    "check_plan_import",
    "check_transformer_tp",
    "default_sequence_parallel",
    "divides_problems",
    "pipeline_stage_problems",
    "plan_import_problems",
    "transformer_tp_problems",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def divides_problems(tp: int, sizes: Mapping[str, int]) -> list[str]:
    """One message per named size that does not split evenly over ``tp`` ranks, each listing
    the tp that divide every size."""
    bad = [(name, size) for name, size in sizes.items() if size % tp]
    if not bad:
        return []
    choices = ", ".join(map(str, _divisors(math.gcd(*sizes.values()))))
    return [
        f"tp={tp} does not divide {name}={size}; choose tp in {{{choices}}}" for name, size in bad
    ]


def check_divides(tp: int, sizes: Mapping[str, int]) -> None:
    """Every named size must split evenly over ``tp`` ranks; the refusal lists the tp that do."""
    refuse(divides_problems(tp, sizes))


def transformer_tp_problems(
    config: ModelConfig,
    tp: int,
    *,
    head_sharded: bool = True,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
) -> list[str]:
    """Every problem of the reference Transformer's sizes against ``tp`` (pure)."""
    kv_heads, ffn_dim = config.n_kv_heads, config.ffn_dim
    assert kv_heads and ffn_dim  # filled in by ModelConfig.__post_init__
    sizes = {"n_heads": config.n_heads, "n_kv_heads": kv_heads}
    if len(config.custom_ffn_layers) < config.n_layers:  # MoE blocks run replicated over tp
        sizes["ffn_dim"] = ffn_dim
    if head_sharded:
        sizes["vocab_size"] = config.vocab_size
    problems = divides_problems(tp, sizes)
    if sequence_parallel and seq_len is not None and seq_len % tp:
        problems.append(
            f"sequence length {seq_len} is not divisible by tp={tp}, which sequence parallelism needs; "
            f"choose a multiple of {tp} or sequence_parallel=False"
        )
    return problems


def check_transformer_tp(
    config: ModelConfig,
    tp: int,
    *,
    head_sharded: bool = True,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
) -> None:
    """Pure checks of the reference Transformer's sizes against ``tp`` (run before any launch)."""
    refuse(
        transformer_tp_problems(
            config,
            tp,
            head_sharded=head_sharded,
            seq_len=seq_len,
            sequence_parallel=sequence_parallel,
        )
    )


def plan_import_problems(path: str, allow_import: bool | Sequence[str]) -> list[str]:
    """Why ``"package.module:NAME"`` may not be imported (pure): a malformed path, or a module
    that ``allow_import`` does not permit. Importing runs the module's code: only
    ``allow_import=True`` or a module prefix listed in ``allow_import`` permits it."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        return [f"plan={path!r}: an import path must look like 'package.module:NAME'"]
    allowed = allow_import is True or (
        not isinstance(allow_import, bool)
        and any(
            module_name == p or module_name.startswith(p.rstrip(".") + ".") for p in allow_import
        )
    )
    if not allowed:
        return [
            f"plan={path!r}: importing '{module_name}' runs its code, and imports are off by default; "
            f"allow it with allow_import=['{module_name}'] (Python) or --allow-import "
            f"{module_name} (forge's command line)"
        ]
    return []


def check_plan_import(path: str, allow_import: bool | Sequence[str]) -> str:
    """Check that ``"package.module:NAME"`` may be imported; returns the module name (pure check).

    Importing runs the module's code: only ``allow_import=True`` or a module prefix listed in
    ``allow_import`` permits it.
    """
    refuse(plan_import_problems(path, allow_import))
    return path.partition(":")[0]


def pipeline_stage_problems(
    *, sequence_parallel: bool | None, loss_parallel: bool, pp: int | None = None
) -> list[str]:
    """What TP cannot give on pipeline stages (``pp``: the pipeline degree when known): an
    explicit sequence parallelism (``None``, "auto", is simply off there: see
    :func:`default_sequence_parallel`) and loss parallelism. The one wording of forge's config
    check, ``ParallelPlan.parallelize_stages`` and :func:`apply_tensor_parallel`."""
    where = f"with parallelism.pp={pp}" if pp else "on a pipeline stage"
    problems = []
    if sequence_parallel:
        problems.append(
            f"tp.sequence_parallel=true {where}: what passes between pipeline stages must be a "
            'plain tensor, not a sequence-sharded one; set tp.sequence_parallel=false (or "auto", '
            "which is off under pp; sequence_parallel=False or None in Python)"
        )
    if loss_parallel:
        problems.append(
            f"tp.loss_parallel=true {where}: the last pipeline stage hands plain logits to the "
            "schedule's loss; set tp.loss_parallel=false"
        )
    return problems


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
