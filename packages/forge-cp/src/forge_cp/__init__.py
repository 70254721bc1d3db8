"""forge_cp: context parallelism, so sequences too long for one device's activations train.

Each sequence is cut into ``2 cp`` chunks and rank ``r`` of the ``cp`` axis keeps chunks ``r``
and ``2 cp - 1 - r`` (:mod:`forge_cp.sequence`: equal causal work per rank). Attention stays
exact: the ranks all-gather keys and values and each chunk attends to its prefix
(:mod:`forge_cp.attention`). :func:`apply_context_parallel` installs both on a model through
forge_core's contracts; forge_core's training step then shards inputs, targets and positions
and reduces the loss over the cp ranks; FSDP2 shards the parameters over ``dp_shard x cp``.

- :func:`apply_context_parallel`, :class:`LoadBalancedShard` (:mod:`forge_cp.apply`)
- :class:`ContextParallelAttention`: the exact all-gather attention kernel
  (:mod:`forge_cp.attention`); :class:`HeadParallelAttention`: the head-parallel one, ~1/cp
  memory (:mod:`forge_cp.heads`); :class:`CPConfig` (``[cp] variant``) picks one
- :func:`shard_sequence`, :func:`gather_sequence`, :func:`sequence_positions`,
  :func:`chunk_order`: the layout (:mod:`forge_cp.sequence`)
- :func:`cp_problems`, :func:`cp_pipeline_problems`: pre-launch checks (:mod:`forge_cp.checks`,
  no torch import; ``apply_context_parallel`` says the pipeline one's words too)

Order: PP split -> TP -> **CP** -> EP -> Float8 -> domain -> AC -> compile -> FSDP2 (or DDP).
Depends on forge_core and torch.
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

_EXPORTS = {
    "LoadBalancedShard": "apply",
    "apply_context_parallel": "apply",
    "ContextParallelAttention": "attention",
    "CP_VARIANTS": "config",
    "CPConfig": "config",
    "HeadParallelAttention": "heads",
    "cp_variant_problems": "checks",
    "head_split_problem": "checks",
    "cp_pipeline_problems": "checks",
    "cp_problems": "checks",
    "seq_len_choices": "checks",
    "chunk_order": "sequence",
    "gather_sequence": "sequence",
    "sequence_positions": "sequence",
    "shard_sequence": "sequence",
}

if TYPE_CHECKING:
    from .apply import LoadBalancedShard, apply_context_parallel
    from .attention import ContextParallelAttention
    from .checks import (
        cp_pipeline_problems,
        cp_problems,
        cp_variant_problems,
        head_split_problem,
        seq_len_choices,
    )
    from .config import CP_VARIANTS, CPConfig
    from .heads import HeadParallelAttention
    from .sequence import chunk_order, gather_sequence, sequence_positions, shard_sequence

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "CP_VARIANTS",
    "CPConfig",
    "ContextParallelAttention",
    "HeadParallelAttention",
    "LoadBalancedShard",
    "apply_context_parallel",
    "chunk_order",
    "cp_pipeline_problems",
    "cp_problems",
    "cp_variant_problems",
    "gather_sequence",
    "head_split_problem",
    "seq_len_choices",
    "sequence_positions",
    "shard_sequence",
]
