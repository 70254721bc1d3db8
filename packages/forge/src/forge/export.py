"""``forge export``: consolidate a ``forge train`` checkpoint into one safetensors file or a
Hugging Face Llama folder. The file formats and name maps are forge-checkpoint's
(:mod:`forge_checkpoint.export`); this module rebuilds the model from the stored config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from forge_checkpoint.export import export_hf_llama, save_safetensors
from forge_core import ForgeConfigError

__all__ = ["export_checkpoint"]


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    layout: str = "safetensors",
    verify: bool = True,
) -> Path:
    """Consolidate a ``forge train`` checkpoint (any layout it was saved under) in one process.

    ``layout="safetensors"``: one file ``out`` with forge's parameter names (the config and step
    in its metadata). ``layout="hf"``: a Hugging Face Llama folder ``out`` (dense reference
    models only). No process group is needed; the model is rebuilt on the CPU from the config
    stored in the checkpoint and filled from its shards. ``verify=False`` skips checking the
    files against the checkpoint's manifest (for a caller that just did).
    """
    from forge_checkpoint.dcp import load_model_weights
    from forge_checkpoint.files import read_train_state, verify_checkpoint

    from .build import materialize, model_from_config
    from .config import load_config

    if layout not in ("safetensors", "hf"):
        raise ForgeConfigError(f"layout={layout!r}: choose 'safetensors' or 'hf'")
    state = read_train_state(checkpoint)
    if verify:  # NOTE: a flipped byte in a shard would otherwise load silently
        verify_checkpoint(checkpoint)
    cfg = load_config(state["config"])
    if layout == "hf" and (cfg.is_vlm or cfg.is_field):
        raise ForgeConfigError(
            "only the reference decoder has a Hugging Face Llama layout; export this model "
            "with layout='safetensors'"
        )
    model = materialize(model_from_config(cfg), "cpu", cfg.training.seed)
    load_model_weights(checkpoint, model)
    weights = model.state_dict()
    if layout == "hf":
        return export_hf_llama(weights, cfg.model, out)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(
        weights,
        path,
        metadata={"forge_step": str(state["step"]), "forge_config": json.dumps(state["config"])},
    )
    return path
