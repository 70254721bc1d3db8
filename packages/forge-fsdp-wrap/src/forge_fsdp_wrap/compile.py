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

:func:`compile_after_sharding` is the other scope: the whole sharded model compiled once, after
FSDP2 (``nn.Module.compile``), for models whose blocks cannot be compiled on their own.
"""

from __future__ import annotations

import torch.nn as nn
from forge_core.contracts import opts_out_of_compile
from forge_core.errors import ForgeConfigError
from forge_core.stages import applied_stages, stage
from forge_core.torch_compat import is_compiled

from .blocks import component_blocks

__all__ = ["apply_compile", "compile_after_sharding"]


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


def compile_after_sharding(model: nn.Module, *, scope: str, backend: str = "inductor") -> nn.Module:
    """What a plan with compile on does after sharding, by ``scope``; returns the model.

    - ``scope='blocks'``: nothing more: the blocks were compiled before FSDP2
      (:func:`apply_compile`). Refused if they were not (the model was not parallelized yet).
    - ``scope='model'``: compiles ``model`` in place (``nn.Module.compile``: parameter and
      state-dict names keep no ``_orig_mod.`` prefix), with ``backend`` and static shapes;
      FSDP2's hooks run eagerly between graphs. A model already compiled is returned unchanged
      (never compiled twice); one whose blocks are compiled is refused (they would be compiled
      again).

    NOTE: static shapes (``dynamic=False``) as for the blocks: DTensor (TP) fails under symbolic
    shapes in inductor, so each new input shape compiles its own graph.

    NOTE: under FSDP2 the graphs stop at every FSDP2 unit: dynamo runs FSDP2's hooks eagerly
    (``torch._dynamo.config.skip_fsdp_hooks``), and a graph break inside a loop makes it run that
    whole frame eagerly. On forge's Transformer (torch 2.15) the root's forward, whose loop over
    the blocks crosses each block's hooks, runs eagerly and each block's forward becomes the
    compiled graph, so ``"blocks"`` is the better scope for an FSDP2 model; ``"model"`` pays off
    where no hooks cut the model (no data parallelism, DDP, or units not called in a loop).
    """
    compiled_blocks = "compile" in applied_stages(model)
    if scope == "blocks":
        if not compiled_blocks:
            raise ForgeConfigError(
                "maybe_compile with compile_scope='blocks': the blocks are compiled inside "
                "parallelize(), which has not run on this model; call "
                "plan.maybe_compile(plan.parallelize(model))"
            )
        return model
    if is_compiled(model):
        return model  # already compiled as a whole
    if compiled_blocks:
        raise ForgeConfigError(
            "maybe_compile with compile_scope='model' on a model whose blocks are already "
            "compiled (apply_compile, or a plan with compile_scope='blocks'): it would compile "
            "them twice; use compile_scope='blocks', or rebuild the model without block compile"
        )
    model.compile(backend=backend, dynamic=False)
    return model
