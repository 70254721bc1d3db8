"""forge_core: what every forge layer shares.

- configs: :class:`ParallelismConfig`, :class:`ModelConfig`, :func:`load_config`
- errors: :class:`ForgeConfigError`
- the stage-order contract (:mod:`forge_core.stages`)
- mesh-axis helpers (:mod:`forge_core.mesh_dims`)
- the reference :class:`Transformer`
- the parity harness (:mod:`forge_core.training`, :mod:`forge_core.harness`)

Depends on torch only.
"""

from .blocks import find_block_container, find_blocks
from .config import ForgeConfig, ParallelismConfig, TPConfig, TrainingConfig, load_config
from .errors import ForgeConfigError
from .mesh_dims import (
    AXES,
    axis_size,
    dp_rank_and_size,
    get_dp_mesh,
    get_tp_mesh,
    has_axis,
    has_dp_mesh,
    sub_mesh,
)
from .model import PRESETS, ModelConfig, Transformer, TransformerBlock
from .stages import ORDER_TEXT, applied_stages, check_stage, record_stage, stage

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "ORDER_TEXT",
    "PRESETS",
    "ForgeConfig",
    "ForgeConfigError",
    "ModelConfig",
    "ParallelismConfig",
    "TPConfig",
    "TrainingConfig",
    "Transformer",
    "TransformerBlock",
    "applied_stages",
    "axis_size",
    "check_stage",
    "dp_rank_and_size",
    "find_block_container",
    "find_blocks",
    "get_dp_mesh",
    "get_tp_mesh",
    "has_axis",
    "has_dp_mesh",
    "load_config",
    "record_stage",
    "stage",
    "sub_mesh",
]
