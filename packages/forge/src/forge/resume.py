"""Which checkpoint a ``forge train`` run resumes from, and whether it holds this config's model.

No torch import: the launcher decides before any rank starts (and before it pays for torch).
The checkpoint files themselves (names, manifest, verification) are forge-checkpoint's
:mod:`forge_checkpoint.files`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from forge_checkpoint.files import (
    CheckpointDamaged,
    find_latest,
    latest_intact,
    read_train_state,
    verify_checkpoint,
)
from forge_core.errors import ForgeConfigError

from .config import ForgeConfig

__all__ = ["resume_point"]

#: ModelConfig fields that decide the shapes a checkpoint holds.
_SHAPE_FIELDS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "tie_embeddings",
    "moe_every",
    "num_experts",
    "moe_ffn_dim",
    "num_shared_experts",
)


def resume_point(cfg: ForgeConfig) -> tuple[Path | None, list[str]]:
    """The checkpoint a run of ``cfg`` resumes from (None: a fresh start), and a line for each
    newer damaged checkpoint skipped on the way.

    ``checkpoint.resume = "latest"``: the newest checkpoint that verifies (raises
    :class:`CheckpointDamaged` when there are checkpoints but none is intact); a path: that
    checkpoint, which must verify. ``checkpoint.verify = false`` takes them unread. Either way
    the saved model must have ``cfg``'s shapes (:class:`ForgeConfigError` names what differs).
    """
    ck = cfg.checkpoint
    skipped: list[str] = []
    if ck.resume == "none":
        return None, skipped
    if ck.resume == "latest":
        if ck.verify:
            chosen, skipped = latest_intact(cfg.checkpoint_dir)
        else:
            chosen = find_latest(cfg.checkpoint_dir)
        if chosen is None:
            if skipped:
                raise CheckpointDamaged(
                    f"no intact checkpoint in {str(cfg.checkpoint_dir)!r} ({len(skipped)} "
                    "damaged); set checkpoint.resume=none to start over"
                )
            return None, skipped
    else:
        chosen = Path(ck.resume)
        read_train_state(chosen)  # a path: it must be a forge checkpoint
        if ck.verify:
            verify_checkpoint(chosen)
    _check_fits(cfg, chosen)
    return chosen, skipped


def _check_fits(cfg: ForgeConfig, path: Path) -> None:
    """The checkpoint at ``path`` must hold ``cfg``'s model (shapes and model sections)."""
    saved = read_train_state(path).get("config", {})
    saved_model = saved.get("model", {}) if isinstance(saved, dict) else {}
    mine = dataclasses.asdict(cfg.model)
    differ = [
        f"{k}={saved_model[k]!r} there, {mine[k]!r} here"
        for k in _SHAPE_FIELDS
        if k in saved_model and saved_model[k] != mine[k]
    ]
    for section in ("field", "vision", "adapter"):
        theirs, ours = saved.get(section), getattr(cfg, section)
        if (theirs is None) != (ours is None) or (
            ours is not None and theirs != dataclasses.asdict(ours)
        ):
            differ.append(f"[{section}] differs")
    if differ:
        raise ForgeConfigError(
            f"checkpoint {path.name} was saved for another model ({'; '.join(differ[:3])}); "
            "resume with the config that saved it, or set checkpoint.resume=none"
        )
