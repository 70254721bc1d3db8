"""Finding a model's repeated blocks (the units FSDP2 shards and AC/compile wrap).

Works on the reference Transformer (``layers``), Hugging Face models (``model.layers``,
``transformer.h``, ...), and any model holding its blocks in a ModuleList/ModuleDict: the first
container, in module order, whose children all share one class and that holds the most
parameters among such containers.
"""

from __future__ import annotations

import torch.nn as nn
from forge_core.contracts import declared_components, model_components
from forge_core.errors import ForgeConfigError, did_you_mean

__all__ = ["Block", "component_blocks", "find_block_container", "find_blocks"]

#: ``(container, key, block)``: ``container[key]`` is the block.
Block = tuple[nn.Module, str, nn.Module]

_KNOWN_PATHS = (
    "layers",
    "model.layers",
    "model.language_model.layers",
    "transformer.h",
    "model.decoder.layers",
    "decoder.layers",
    "blocks",
    "encoder.layers",
)


def _get(model: nn.Module, path: str) -> nn.ModuleList | nn.ModuleDict | None:
    obj: nn.Module | None = model
    for part in path.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj if isinstance(obj, (nn.ModuleList, nn.ModuleDict)) and len(obj) > 0 else None


def find_block_container(model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
    """The ModuleList/ModuleDict holding ``model``'s transformer blocks."""
    for path in _KNOWN_PATHS:
        found = _get(model, path)
        if found is not None:
            return found
    best, best_params = None, -1
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0:
            children = list(module.children())
            if len({type(c) for c in children}) == 1:
                n = sum(p.numel() for p in module.parameters())
                if n > best_params:
                    best, best_params = module, n
    if best is None:
        raise ForgeConfigError(
            f"cannot find the blocks of {type(model).__name__}: expected a ModuleList/ModuleDict "
            "of blocks (e.g. model.layers); put the blocks in one"
        )
    return best


def find_blocks(model: nn.Module) -> list[Block]:
    """``(container, key, block)`` for every block, in order; ``container[key]`` is the block."""
    container = find_block_container(model)
    if isinstance(container, nn.ModuleDict):
        return [(container, key, block) for key, block in container.items()]
    return [(container, str(i), block) for i, block in enumerate(container)]


def component_blocks(
    model: nn.Module,
    names: tuple[str, ...] | list[str] | None = None,
    *,
    required: bool = True,
) -> list[tuple[str, nn.Module, list[Block]]]:
    """``(component name, module, its blocks)`` per component of ``model`` (forward order).

    A model without components (``forge_core.contracts.model_components``) is one part named
    ``""`` whose blocks must exist unless ``required=False`` (a small conv net is one FSDP2
    unit). A component without a block container (an adapter) has no blocks. ``names`` keeps
    only those components (an unknown name is an error).
    """
    components = model_components(model)
    if not components:
        try:
            return [("", model, find_blocks(model))]
        except ForgeConfigError:
            if required:
                raise
            return [("", model, [])]
    known = [name for name, _ in components]
    declared = declared_components(model)  # incl. those a pipeline stage lacks
    for name in names or ():
        if name not in known and name not in declared:
            raise ForgeConfigError(
                f"{type(model).__name__} has no component '{name}'{did_you_mean(name, known)}; "
                f"components: {known}"
            )
    parts = []
    for name, module in components:
        if names is not None and name not in names:
            continue
        try:
            blocks = find_blocks(module)
        except ForgeConfigError:
            blocks = []
        parts.append((name, module, blocks))
    return parts
