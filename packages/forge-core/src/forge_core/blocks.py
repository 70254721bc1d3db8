"""Finding a model's repeated blocks (the units FSDP2 shards and AC/compile wrap).

Works on the reference Transformer (``layers``), Hugging Face models (``model.layers``,
``transformer.h``, ...), and any model holding its blocks in a ModuleList/ModuleDict: the first
container, in module order, whose children all share one class and that holds the most
parameters among such containers.
"""

from __future__ import annotations

import torch.nn as nn

from .errors import ForgeConfigError

__all__ = ["find_block_container", "find_blocks"]

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


def _get(model: nn.Module, path: str) -> nn.Module | None:
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


def find_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(container, key, block)`` for every block, in order; ``container[key]`` is the block."""
    container = find_block_container(model)
    if isinstance(container, nn.ModuleDict):
        return [(container, key, block) for key, block in container.items()]
    return [(container, str(i), block) for i, block in enumerate(container)]
