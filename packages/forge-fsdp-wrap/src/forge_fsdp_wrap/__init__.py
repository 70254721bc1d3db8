"""forge_fsdp_wrap: FSDP2, HSDP, DDP, mixed precision, activation checkpointing, compile.

The last stages of forge's order (TP -> CP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2/DDP):

- :func:`apply_ac` wraps blocks for activation checkpointing (``none|full|selective|op``)
- :func:`apply_compile` compiles each block in place; :func:`compile_after_sharding` the whole
  sharded model (or nothing more, for per-block compile)
- :func:`apply_fsdp2` shards each block, then the root; a 2-D DP mesh gives HSDP; a model made
  of components (a VLM) gets units per component, and a frozen component may stay replicated
  (:func:`frozen_bytes_rule`)
- :func:`apply_ddp` replicates with DistributedDataParallel
- :func:`enable_autocast` low-precision compute for DDP / single-device models
- :func:`unshard_fsdp2_model` gathers full parameters for a while (eval, export)
- :func:`reshard` reshards every FSDP2 unit: what to call before building an optimizer after a
  forward that no backward followed (an optimizer holding FSDP2's unsharded copies is stopped at
  its first step with that advice; :mod:`forge_fsdp_wrap.copies`)

Every ``apply_*`` goes through forge_core's stage-order contract. Gradient accumulation:
``forge_core.training.set_gradient_sync(model, False)`` for all micro-batches but the last.
Depends on forge_core and torch only.
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

# NOTE: imported on first use, so that the pure checks (forge_fsdp_wrap.checks) load without torch.
_EXPORTS = {
    "AC_MODES": "checks",
    "check_ac_mode": "checks",
    "apply_ac": "ac",
    "find_block_container": "blocks",
    "find_blocks": "blocks",
    "apply_compile": "compile",
    "compile_after_sharding": "compile",
    "apply_ddp": "data_parallel",
    "apply_fsdp2": "data_parallel",
    "default_mp_policy": "data_parallel",
    "enable_autocast": "data_parallel",
    "frozen_bytes_rule": "data_parallel",
    "unshard_fsdp2_model": "data_parallel",
    "reshard": "copies",
}

if TYPE_CHECKING:
    from .ac import apply_ac
    from .blocks import find_block_container, find_blocks
    from .checks import AC_MODES, check_ac_mode
    from .compile import apply_compile, compile_after_sharding
    from .copies import reshard
    from .data_parallel import (
        apply_ddp,
        apply_fsdp2,
        default_mp_policy,
        enable_autocast,
        frozen_bytes_rule,
        unshard_fsdp2_model,
    )

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"
__all__ = [
    "AC_MODES",
    "apply_ac",
    "check_ac_mode",
    "apply_compile",
    "compile_after_sharding",
    "apply_ddp",
    "apply_fsdp2",
    "default_mp_policy",
    "enable_autocast",
    "find_block_container",
    "find_blocks",
    "frozen_bytes_rule",
    "reshard",
    "unshard_fsdp2_model",
]
