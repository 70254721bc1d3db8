"""forge_core: what every forge layer shares.

- configs every layer needs: :class:`ParallelismConfig` (the layout), :class:`ModelConfig` (the
  reference model) (each layer owns its own config section; ``forge.load_config`` composes them)
- errors: :class:`ForgeConfigError`
- the stage-order contract (:mod:`forge_core.stages`)
- mesh-axis helpers (:mod:`forge_core.mesh_dims`)
- the reference :class:`Transformer`
- the training step every job runs (:mod:`forge_core.training`)
- the test harness, kept apart (:mod:`forge_core.testing`: rank pools, the parity check, the
  host-sync guard)
- contracts between layers (:mod:`forge_core.contracts`: optimizer hooks, auxiliary losses,
  expert-parallel parameters)

Depends on torch only; the config modules (``config``, ``model_config``, ``errors``) import
without it.
"""

from typing import TYPE_CHECKING

from .lazy import lazy_exports

# NOTE: names are imported when first used (PEP 562), so that ``forge_core.config`` and
# ``forge_core.errors`` load without torch: the launcher checks a config in a fraction of a second
# before it imports torch (seconds) to start ranks.
_EXPORTS = {
    "ParallelismConfig": "config",
    "attach_optimizer_hooks": "contracts",
    "pop_aux_losses": "contracts",
    "ForgeConfigError": "errors",
    "AXES": "mesh_dims",
    "axis_size": "mesh_dims",
    "dp_rank_and_size": "mesh_dims",
    "get_dp_mesh": "mesh_dims",
    "get_ep_mesh": "mesh_dims",
    "get_expert_dp_mesh": "mesh_dims",
    "get_tp_mesh": "mesh_dims",
    "has_axis": "mesh_dims",
    "has_dp_mesh": "mesh_dims",
    "sub_mesh": "mesh_dims",
    "PRESETS": "model_config",
    "ModelConfig": "model_config",
    "Transformer": "model",
    "TransformerBlock": "model",
    "ORDER_TEXT": "stages",
    "applied_stages": "stages",
    "check_stage": "stages",
    "record_stage": "stages",
    "stage": "stages",
    "HostSyncError": "testing.sync_guard",
    "count_host_syncs": "testing.sync_guard",
    "no_host_sync": "testing.sync_guard",
}

if TYPE_CHECKING:
    from .config import ParallelismConfig
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
    from .model import Transformer, TransformerBlock
    from .model_config import PRESETS, ModelConfig
    from .stages import ORDER_TEXT, applied_stages, check_stage, record_stage, stage
    from .testing.sync_guard import HostSyncError, count_host_syncs, no_host_sync


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "ORDER_TEXT",
    "PRESETS",
    "ForgeConfigError",
    "HostSyncError",
    "ModelConfig",
    "ParallelismConfig",
    "Transformer",
    "TransformerBlock",
    "applied_stages",
    "attach_optimizer_hooks",
    "count_host_syncs",
    "axis_size",
    "check_stage",
    "dp_rank_and_size",
    "get_dp_mesh",
    "get_ep_mesh",
    "get_expert_dp_mesh",
    "get_tp_mesh",
    "has_axis",
    "has_dp_mesh",
    "no_host_sync",
    "pop_aux_losses",
    "record_stage",
    "stage",
    "sub_mesh",
]
