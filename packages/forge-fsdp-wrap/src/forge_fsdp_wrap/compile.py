"""torch.compile per block, in place.

Each block is compiled on its own (``module.compile()``), not the whole model: all blocks share
one graph (compiled once, reused), graph breaks at FSDP2's hooks between blocks are avoided, and
parameter names do not change (no ``_orig_mod.`` prefix, so checkpoints and plans still match).
Runs after AC (the checkpoint boundaries are part of the compiled block) and before FSDP2.
"""

from __future__ import annotations

import torch.nn as nn
from forge_core.blocks import find_blocks
from forge_core.stages import stage

__all__ = ["apply_compile"]


def apply_compile(
    model: nn.Module, *, backend: str = "inductor", fullgraph: bool = True
) -> nn.Module:
    """Compile every block of ``model`` in place; returns ``model``."""
    with stage(model, "compile"):
        for _, _, block in find_blocks(model):
            block.compile(backend=backend, fullgraph=fullgraph)
    return model
