"""The stage-order contract: PP split -> TP -> CP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2/DDP.

Why an order: the pipeline split comes first because every later stage applies to each stage
module (a stage records ``pp`` and then its own order); TP must see raw ``nn.Linear`` modules;
CP swaps the attention kernel of the attention modules TP left in place, before AC wraps and
compile traces the blocks that call it (and before FSDP2, which shards over dp_shard x cp);
Float8 swaps Linears after TP/EP split them
and before AC wraps blocks; domain parallelism swaps convolutions and norms for their
height-slab forms, which AC and compile must then see; FSDP2 shards last so it sees the final parameters (DTensors from TP,
float8 weights). Applied in another order the model still runs but computes different numbers,
so every ``apply_*`` of every layer goes through :func:`stage` which refuses an out-of-order or
repeated stage with a :class:`ForgeConfigError` naming the right order.

A model made of components (``forge_core.contracts.model_components``, e.g. a vision-language
model) has one order per component: a stage applied to the whole model is checked against and
recorded on every component too, and a stage applied to one component (TP on the decoder) only
there. Stages are recorded on the model itself (``model._forge_stages``), unwrapping ``torch.compile``
and DDP wrappers, so the record travels with the model and no module-level state exists. Stages
applied behind forge's back (``fully_shard`` or DDP called directly, a checkpoint wrapper) are
detected by looking at the modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn as nn

from .contracts import model_components, unwrap  # unwrap: its old home was here
from .errors import ForgeConfigError

__all__ = [
    "STAGES",
    "ORDER_TEXT",
    "applied_stages",
    "check_stage",
    "record_stage",
    "stage",
    "unwrap",
]

#: Stage name -> rank in the order. fsdp2 and ddp share a rank: a model gets one of them.
STAGES: dict[str, int] = {
    "pp": -1,
    "tp": 0,
    "cp": 1,
    "ep": 2,
    "float8": 3,
    "domain": 4,
    "ac": 5,
    "compile": 6,
    "fsdp2": 7,
    "ddp": 7,
}
ORDER_TEXT = "PP split -> TP -> CP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2 (or DDP)"
_ATTR = "_forge_stages"


def _detected_stages(model: nn.Module) -> list[str]:
    """Stages visible in the module tree even if they were applied without forge."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from .torch_compat import is_checkpoint_wrapper

    modules = list(model.modules())
    found = []
    if any(is_checkpoint_wrapper(m) for m in modules):
        found.append("ac")
    if any(isinstance(m, FSDPModule) for m in modules):
        found.append("fsdp2")
    if isinstance(model, DistributedDataParallel):
        found.append("ddp")
    return found


def applied_stages(model: nn.Module) -> list[str]:
    """Stages applied to ``model`` so far, in the order they were applied."""
    recorded = list(unwrap(model).__dict__.get(_ATTR, ()))
    return recorded + [s for s in _detected_stages(model) if s not in recorded]


def check_stage(model: nn.Module, name: str) -> None:
    """Raise ``ForgeConfigError`` if stage ``name`` may not be applied to ``model`` now."""
    if name not in STAGES:
        raise ForgeConfigError(f"unknown stage '{name}'; stages are {sorted(STAGES)}")
    for target in _with_components(model)[1:]:  # a component's own record counts too
        check_stage(target, name)
    done = applied_stages(model)
    if name in done:
        raise ForgeConfigError(
            f"stage '{name}' was already applied to this model (applied so far: {done}); "
            "each stage is applied once"
        )
    later = [s for s in done if STAGES[s] >= STAGES[name]]
    if later:
        raise ForgeConfigError(
            f"cannot apply '{name}' after {later}: a wrong order gives silently wrong numbers. "
            f"forge applies stages in the order {ORDER_TEXT}; rebuild the model and apply "
            f"'{name}' before '{later[0]}'"
        )


def record_stage(model: nn.Module, name: str) -> None:
    """Record that stage ``name`` has been applied to ``model`` (and to each of its components)."""
    for target in _with_components(model):
        records = target.__dict__.setdefault(_ATTR, [])
        if name not in records:  # NOTE: a component shared by a pipeline rank model and a stage
            records.append(name)


def _with_components(model: nn.Module) -> list[nn.Module]:
    inner = unwrap(model)
    return [inner, *(unwrap(m) for _, m in model_components(inner))]


@contextmanager
def stage(model: nn.Module, name: str) -> Iterator[None]:
    """Check the order before the body runs; record the stage only if the body succeeds."""
    check_stage(model, name)
    yield
    record_stage(model, name)
