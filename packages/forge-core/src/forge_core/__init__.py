"""forge_core: what every forge layer shares.

- configs: :class:`ParallelismConfig`, :class:`ModelConfig`, :func:`load_config`
- errors: :class:`ForgeConfigError`
- the stage-order contract (:mod:`forge_core.stages`)
- mesh-axis helpers (:mod:`forge_core.mesh_dims`)
- the reference :class:`Transformer`
- the parity harness (:mod:`forge_core.training`, :mod:`forge_core.harness`)
- contracts between layers (:mod:`forge_core.contracts`: optimizer hooks, auxiliary losses,
  expert-parallel parameters) and the host-sync guard (:mod:`forge_core.sync_guard`)

Depends on torch only.
"""

from .blocks import find_block_container, find_blocks
from .config import ForgeConfig, ParallelismConfig, TPConfig, TrainingConfig, load_config
from .contracts import attach_optimizer_hooks, pop_aux_losses
from .errors import ForgeConfigError
from .mesh_dims import (
    AXES,
    axis_size,
    dp_rank_and_size,
    get_dp_mesh,
    get_ep_mesh,
    get_expert_dp_mesh,
    get_tp_mesh,
    has_axis,
    has_dp_mesh,
    sub_mesh,
)
from .model import PRESETS, ModelConfig, Transformer, TransformerBlock
from .stages import ORDER_TEXT, applied_stages, check_stage, record_stage, stage
from .sync_guard import HostSyncError, count_host_syncs, no_host_sync

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "ORDER_TEXT",
    "PRESETS",
    "ForgeConfig",
    "ForgeConfigError",
    "HostSyncError",
    "ModelConfig",
    "ParallelismConfig",
    "TPConfig",
    "TrainingConfig",
    "Transformer",
    "TransformerBlock",
    "applied_stages",
    "attach_optimizer_hooks",
    "count_host_syncs",
    "axis_size",
    "check_stage",
    "dp_rank_and_size",
    "find_block_container",
    "find_blocks",
    "get_dp_mesh",
    "get_ep_mesh",
    "get_expert_dp_mesh",
    "get_tp_mesh",
    "has_axis",
    "has_dp_mesh",
    "load_config",
    "no_host_sync",
    "pop_aux_losses",
    "record_stage",
    "stage",
    "sub_mesh",
]
