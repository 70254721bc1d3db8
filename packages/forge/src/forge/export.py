"""``forge export``: consolidate a ``forge train`` checkpoint into one safetensors file or a
Hugging Face folder (forge's model as Llama; a Hugging Face model in its own layout, shard by
shard). The file formats, name maps and what an output path may be are
forge-checkpoint's (:mod:`forge_checkpoint.export`); this module rebuilds the model from the
stored config. Importing it imports no torch, so :func:`check_export_out` answers at once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from forge_checkpoint.export import check_output, export_hf_llama, save_safetensors
from forge_core import ForgeConfigError
from forge_core.errors import refuse

__all__ = ["check_export_out", "export_checkpoint"]

LAYOUTS = ("safetensors", "hf")


def check_export_out(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    layout: str = "safetensors",
    *,
    name: str = "out",
) -> Path:
    """``out`` as a Path if ``layout`` can be exported there from ``checkpoint``; else
    ForgeConfigError naming ``name`` (``--out`` for the CLI). Reads neither the checkpoint nor
    ``out``'s tensors: what an output may be is :func:`forge_checkpoint.export.check_output`'s
    rule (writable, the right kind, no file forge did not write); this adds only that the export
    does not go into the checkpoint itself (it would change what its manifest covers)."""
    if layout not in LAYOUTS:
        raise ForgeConfigError(f"layout={layout!r}: choose 'safetensors' or 'hf'")
    if "\0" in os.fsdecode(checkpoint):
        raise ForgeConfigError(f"checkpoint path {os.fsdecode(checkpoint)!r} contains a NUL byte")
    path = check_output(out, folder=layout == "hf", name=name)
    inside = Path(os.path.abspath(path)).is_relative_to(os.path.abspath(checkpoint))
    if inside and Path(checkpoint).is_dir():
        raise ForgeConfigError(
            f"{name} {str(path)!r} is inside the checkpoint {os.fsdecode(checkpoint)!r}: write the "
            "export outside it"
        )
    return path


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
    files against the checkpoint's manifest (for a caller that just did). ``out`` is checked
    first (:func:`check_export_out`): nothing forge did not write is overwritten.
    """
    from forge_checkpoint.dcp import load_model_weights
    from forge_checkpoint.files import read_train_state, verify_checkpoint

    from .build import materialize, model_from_config
    from .config import load_config
    from .kinds import model_kind

    path = check_export_out(checkpoint, out, layout)
    state = read_train_state(checkpoint)
    if verify:  # NOTE: a flipped byte in a shard would otherwise load silently
        verify_checkpoint(checkpoint)
    cfg = load_config(state["config"])
    if layout == "hf":
        refuse(model_kind(cfg).hf_export_problems())
    if cfg.hf is not None and layout == "hf":
        return _export_hf_directory(checkpoint, cfg.hf.dir, model_from_config(cfg), path)
    model = model_from_config(cfg)
    if cfg.hf is not None:  # NOTE: every tensor is loaded below: no init to draw
        model = model.to_empty(device="cpu")
    else:
        model = materialize(model, "cpu", cfg.training.seed)
    load_model_weights(checkpoint, model)
    weights = model.state_dict()
    if layout == "hf":
        return export_hf_llama(weights, cfg.decoder, path)
    save_safetensors(
        weights,
        path,
        metadata={"forge_step": str(state["step"]), "forge_config": json.dumps(state["config"])},
    )
    return path


def _export_hf_directory(
    checkpoint: str | os.PathLike[str], source: str, meta_model: object, out: Path
) -> Path:
    """A Hugging Face model's checkpoint as a Hugging Face directory, one shard at a time
    (:func:`forge_checkpoint.export_hf_model`): its own names, ``source``'s config.json and
    tokenizer; a tied head is left out as ``save_pretrained`` leaves it."""
    from forge_checkpoint import export_hf_model, load_checkpoint_tensors
    from forge_checkpoint.hf_export import stored_layout

    from .model_spec import hf_weight_sources

    if not (Path(source) / "config.json").is_file():
        raise ForgeConfigError(
            f"the checkpoint's model.hf={source!r} has no config.json any more: the export "
            "copies it (and the tokenizer) from there; restore the directory"
        )
    model = _as_saved(meta_model, checkpoint)
    state = model.state_dict(keep_vars=True)
    seen: set[int] = set()
    shapes = {}
    for name, tensor in state.items():
        if id(tensor) in seen:  # a tied head: the embedding's tensor again
            continue
        seen.add(id(tensor))
        shapes[name] = (tuple(tensor.shape), tensor.dtype)
    sources = hf_weight_sources(model, source)  # NOTE: {} unless MoE blocks were converted
    stored, fill = stored_layout(shapes, sources, load_checkpoint_tensors(checkpoint))
    return export_hf_model(stored, fill, source, out)


def _as_saved(meta_model: Any, checkpoint: str | os.PathLike[str]) -> Any:
    """The meta model with the names its checkpoint holds: a Hugging Face MoE trained under tp
    or ep > 1 was saved with its MoE blocks converted to forge's (forge_moe_ep.hf), so the
    same conversion is applied; the export writes them back in the source's own layout."""
    from forge_checkpoint import model_shapes
    from forge_moe_ep.hf import convert_hf_moe

    saved = set(model_shapes(Path(checkpoint)))
    if saved != set(meta_model.state_dict()):
        convert_hf_moe(meta_model)
    return meta_model
