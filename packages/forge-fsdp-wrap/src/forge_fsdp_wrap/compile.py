"""torch.compile per block, in place.

Each block is compiled on its own (``module.compile()``), not the whole model: all blocks share
one graph (compiled once, reused), graph breaks at FSDP2's hooks between blocks are avoided, and
parameter names do not change (no ``_orig_mod.`` prefix, so checkpoints and plans still match).
A model made of components (a VLM) has each component's blocks compiled. Runs after AC (the
checkpoint boundaries are part of the compiled block) and before FSDP2.

A block holding a module that opts out (``forge_no_compile = True``, see
``forge_core.contracts``; e.g. an MoE layer whose expert-parallel dispatch reads split sizes on
the host) is not compiled whole: its other composite children (attention) are compiled one by
one and the opted-out module runs eagerly. This also keeps FSDP2 units nested inside a block
(expert-parallel blocks are wrapped per sub-module) out of a compiled region, where their hooks
could not be traced.
"""

from __future__ import annotations

import torch.nn as nn
from forge_core.contracts import opts_out_of_compile
from forge_core.stages import stage

from .blocks import component_blocks

__all__ = ["apply_compile"]


def apply_compile(
    model: nn.Module, *, backend: str = "inductor", fullgraph: bool = True, dynamic: bool = False
) -> nn.Module:
    """Compile every block of ``model`` in place; returns ``model``.

    ``dynamic=False`` (static shapes) by default. NOTE: blocks of different shapes that share
    one ``forward`` code object (a VLM's encoder and decoder blocks behind the same checkpoint
    wrapper) would otherwise be recompiled with symbolic shapes after the first mismatch, and
    DTensor (TP) fails under symbolic shapes in inductor (torch 2.15: "unhashable type:
    non-nested SymInt"). Each distinct shape gets its own graph instead.
    """
    with stage(model, "compile"):
        blocks = [b for _, _, part in component_blocks(model) for b in part]
        for _, _, block in blocks:
            if not opts_out_of_compile(block):
                block.compile(backend=backend, fullgraph=fullgraph, dynamic=dynamic)
                continue
            for child in block.children():
                composite = any(True for _ in child.children())
                if composite and not opts_out_of_compile(child):
                    child.compile(backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    return model
