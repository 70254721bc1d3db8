"""Which checkpoint a ``forge train`` run resumes from, and whether it holds this config's model.

The launcher decides before any rank starts. A directory forge did not write in
``checkpoint.dir`` and damaged files are refused before torch is imported; the checks that read
the checkpoint's tensor index (every shard's and RNG file's checkpoint id, and the shapes it
records against a meta-device model of this config) import torch, which the launcher needs
next anyway. The checkpoint files themselves (names, marker, manifest, verification) are
forge-checkpoint's :mod:`forge_checkpoint.files`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from forge_checkpoint.files import (
    MARKER,
    CheckpointDamaged,
    find_latest,
    foreign_dirs,
    latest_intact,
    read_train_state,
    verify_checkpoint,
)
from forge_core.errors import ForgeConfigError

from .config import ForgeConfig

__all__ = ["check_saved_state", "resume_point"]

#: ModelConfig fields that change a model without changing any tensor's shape (a tied head
#: has the same shapes as a separate one); every other difference shows in the shapes.
_UNSHAPED_FIELDS = ("tie_embeddings",)


def resume_point(cfg: ForgeConfig) -> tuple[Path | None, list[str]]:
    """The checkpoint a run of ``cfg`` resumes from (None: a fresh start), and a line for each
    newer damaged checkpoint skipped on the way.

    First, whatever ``checkpoint.resume`` is: ``checkpoint.dir`` must hold no ``step-N`` (or
    ``.tmp-step-N``) that forge did not write (:class:`ForgeConfigError`: move it, or choose
    another directory; forge never deletes it). ``checkpoint.resume = "latest"``: the newest
    checkpoint that verifies (raises :class:`CheckpointDamaged` when there are checkpoints but
    none is intact); a path: that checkpoint, which must verify. Verifying covers the files
    (manifest), the train state (:func:`check_saved_state`) and every shard's and RNG file's
    checkpoint id; ``checkpoint.verify = false`` takes them unread. Either way the saved model
    must have ``cfg``'s tensors, names and shapes (:class:`ForgeConfigError` names what differs).
    """
    ck = cfg.checkpoint
    _refuse_foreign(cfg.checkpoint_dir)
    skipped: list[str] = []
    if ck.resume == "none":
        return None, skipped
    if ck.resume == "latest":
        if ck.verify:
            chosen, skipped = latest_intact(cfg.checkpoint_dir, check=_check_contents)
        else:
            chosen = find_latest(cfg.checkpoint_dir)
        if chosen is None:
            if skipped:
                where = str(cfg.checkpoint_dir)
                raise CheckpointDamaged(
                    f"no intact checkpoint in {where!r} ({len(skipped)} damaged, the newest "
                    f"{skipped[0]}); to start over, move them out of {where!r} or give this "
                    "run another checkpoint.dir"
                )
            return None, skipped
    else:
        chosen = Path(ck.resume)
        read_train_state(chosen)  # a path: it must be a forge checkpoint
        if ck.verify:
            verify_checkpoint(chosen)
            _check_contents(chosen)
    _check_fits(cfg, chosen)
    return chosen, skipped


def _refuse_foreign(root: Path) -> None:
    """Refuse a checkpoint directory holding checkpoint-named entries forge did not write.

    NOTE: a save replaces ``step-N`` and the cleanup of killed saves removes ``.tmp-step-N``;
    forge does neither to a directory it did not mark, so a run beside one would fail at that
    save, after training; refusing before launch keeps the user's files and the run's time.
    """
    foreign = foreign_dirs(root)
    if foreign:
        names = ", ".join(p.name for p in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise ForgeConfigError(
            f"checkpoint.dir={str(root)!r} holds {names}, not written by forge (no valid "
            f"{MARKER} in it); forge never deletes or replaces it: move it out of "
            f"{str(root)!r}, or choose another checkpoint.dir"
        )


def _check_contents(path: Path) -> None:
    """What verifying a manifest cannot show: forge's train-state fields
    (:func:`check_saved_state`), then (torch) every saved rank's shard and RNG file carrying
    this checkpoint's id."""
    check_saved_state(path)
    from forge_checkpoint.binding import verify_shards

    verify_shards(path)


def _damaged(path: Path, field: str, value: Any, why: str) -> CheckpointDamaged:
    return CheckpointDamaged(
        f"{path.name}: train_state.json has {field}={value!r}, {why} (edited after it was written)"
    )


def check_saved_state(path: str | Path) -> dict[str, Any]:
    """The train state ``forge train`` saved in checkpoint ``path``, its fields checked against
    each other; raises :class:`CheckpointDamaged` naming the field.

    The layer checks the step, id, world size and finite numbers
    (:func:`forge_checkpoint.files.check_train_state`); here: ``data_position`` and the
    scheduler's ``last_epoch`` equal the step, the scheduler's ``base_lrs`` equal the param
    groups' ``initial_lr`` (positive), each group's ``lr`` the scheduler's last, and the layout
    (``mesh``) has ``world_size`` ranks.
    """
    path = Path(path)
    state = read_train_state(path)
    step, groups, sched = state["step"], state.get("param_groups"), state.get("scheduler")
    if state.get("data_position") != step:
        raise _damaged(path, "data_position", state.get("data_position"), f"but step={step}")
    if not isinstance(sched, dict) or not isinstance(groups, list):
        raise _damaged(path, "scheduler", sched, "not a scheduler state")
    if sched.get("last_epoch") != step:
        raise _damaged(path, "scheduler.last_epoch", sched.get("last_epoch"), f"but step={step}")
    initial = [g.get("initial_lr") if isinstance(g, dict) else None for g in groups]
    base = sched.get("base_lrs")
    if not all(isinstance(lr, int | float) and math.isfinite(lr) and lr > 0 for lr in initial):
        raise _damaged(path, "param_groups[*].initial_lr", initial, "not learning rates")
    if base != initial:
        raise _damaged(
            path, "scheduler.base_lrs", base, f"but the param groups' initial_lr are {initial}"
        )
    last = sched.get("_last_lr")
    current = [g.get("lr") if isinstance(g, dict) else None for g in groups]
    if last != current:
        raise _damaged(path, "param_groups[*].lr", current, f"but the scheduler's last lr {last}")
    mesh, world = state.get("mesh"), state.get("world_size")
    sizes: list[Any] = list(mesh.values()) if isinstance(mesh, dict) else [None]
    if not all(isinstance(n, int) and n >= 1 for n in sizes) or math.prod(sizes) != world:
        raise _damaged(path, "mesh", mesh, f"not a layout of world_size={world} ranks")
    return state


def _check_fits(cfg: ForgeConfig, path: Path) -> None:
    """The checkpoint at ``path`` must hold ``cfg``'s model: the tensor names and shapes its
    index records equal those of a meta-device model built from ``cfg`` (so no config field
    that changes a parameter or buffer can be forgotten), and the fields that change a model
    without changing shapes (:data:`_UNSHAPED_FIELDS`) and the model sections are equal."""
    saved = read_train_state(path).get("config", {})
    saved = saved if isinstance(saved, dict) else {}
    saved_model = _saved_decoder(saved)
    mine = dataclasses.asdict(cfg.decoder)
    fields = [k for k in mine if k in saved_model and saved_model[k] != mine[k]]
    differ = [f"{k}={saved_model[k]!r} there, {mine[k]!r} here" for k in fields]
    refused = [k for k in fields if k in _UNSHAPED_FIELDS]
    for section in ("field", "vision", "adapter"):
        theirs, ours = saved.get(section), getattr(cfg, section)
        if (theirs is None) != (ours is None) or (
            ours is not None and theirs != dataclasses.asdict(ours)
        ):
            differ.append(f"[{section}] differs")
            refused.append(section)
    tensors = _tensor_differences(cfg, path)
    if refused or tensors:
        what = "; ".join([*differ, *tensors][:4])
        raise ForgeConfigError(
            f"checkpoint {path.name} was saved for another model ({what}); resume with the "
            "config that saved it, or start over in another checkpoint.dir"
        )


def _saved_decoder(saved: dict[str, Any]) -> dict[str, Any]:
    """The decoder fields of a checkpoint's saved config, flat: ``[model]`` and ``[moe]`` (a
    checkpoint written before ``[moe]`` existed has them all in ``[model]``), with
    ``moe_ffn_dim`` filled in as :class:`~forge_moe_ep.MoEModelConfig` fills it."""
    parts = [saved.get(section) for section in ("model", "moe")]
    flat = {k: v for part in parts if isinstance(part, dict) for k, v in part.items()}
    if flat.get("moe_ffn_dim") is None and "ffn_dim" in flat:
        flat["moe_ffn_dim"] = flat["ffn_dim"]
    return flat


def _tensor_differences(cfg: ForgeConfig, path: Path) -> list[str]:
    """How the model tensors of checkpoint ``path`` differ from a meta-device model of ``cfg``
    (names it has that this model lacks, and the reverse, and shapes)."""
    from forge_checkpoint.index import model_shapes

    from .build import model_from_config

    saved = model_shapes(path)
    mine = {k: tuple(v.shape) for k, v in model_from_config(cfg).state_dict().items()}
    lines = []
    extra, missing = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
    if extra:
        lines.append(f"it has {len(extra)} tensor(s) this model lacks: {', '.join(extra[:2])}")
    if missing:
        lines.append(f"it lacks {len(missing)} tensor(s) of this model: {', '.join(missing[:2])}")
    shapes = [k for k in sorted(set(saved) & set(mine)) if saved[k] != mine[k]]
    lines += [f"{k} is {list(saved[k])} there, {list(mine[k])} here" for k in shapes[:2]]
    return lines
