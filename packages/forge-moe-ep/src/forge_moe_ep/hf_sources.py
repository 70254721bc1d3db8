"""Where a converted Hugging Face MoE model's tensors lie in its Hugging Face checkpoint.

:func:`forge_moe_ep.hf.convert_hf_moe` renames and re-lays out every MoE block it converts, so
a checkpoint written by transformers (``save_pretrained``) no longer names the model's tensors.
:func:`hf_checkpoint_sources` says, for each tensor of the converted model that the checkpoint
does not hold under its own name, which stored tensors it is read from and how
(:class:`forge_core.tensor_source.TensorSource`); a reader (``forge_checkpoint.load_hf_weights``)
then reads each rank's experts only, stacking them as it reads. Pure: no file and no tensor is
read, only the stored names and shapes it is given.

What transformers 5.23 writes, by what this module recognises in the stored names:

- experts one by one, ``experts.E.{gate_proj,up_proj,down_proj}.weight`` (Qwen3-MoE,
  Qwen2-MoE, OLMoE, DeepSeek-V2/V3, GLM4-MoE, ...) or ``experts.E.{w1,w3,w2}.weight``
  (Mixtral), each ``[out, in]``: stacked and transposed into ``w1``, ``w3``, ``w2``;
- fused experts, ``experts.gate_up_proj`` and ``experts.down_proj`` in the block's own layout
  (GPT-OSS: interleaved gate / up columns and biases; Llama 4: gate columns then up columns):
  sliced into ``w1`` / ``w3`` (and ``b1`` / ``b3``);
- the router's weight (and ``bias``) where its family keeps it (``gate.weight``,
  ``router.weight``, ``router.gate.weight``, ``gate.wg.weight``) -> ``router.gate.*``; the
  choice's correction bias where its family keeps it (DeepSeek-V3's
  ``gate.e_score_correction_bias``, or on the block) -> ``router.expert_bias`` (zero for a
  family without one);
- experts that are not gated (Nemotron-H): ``experts.up_proj`` (or ``experts.E.up_proj.weight``)
  -> ``w1``, and ``down_proj`` -> ``w2``;
- a shared expert ``shared_experts.*`` -> ``shared_expert.*``, an output norm -> ``post_norm.*``,
  latent projections -> ``expert_in.*`` / ``expert_out.*`` (the modules are kept as they are);
  a hash-routed block's table (``gate.tid2eid``) -> ``expert_table``;
- a block transformers names ``mlp`` in memory and ``block_sparse_moe`` on disk (Mixtral).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
from forge_core.tensor_source import TensorSource

from .hf import HFMoE, correction_bias, kept_module, kept_paths
from .hf_families import _Family

__all__ = ["hf_checkpoint_sources"]

#: Names a block's attribute may have on disk besides its own (transformers' renames at load).
_STORED_BLOCK_NAMES = {"mlp": ("block_sparse_moe",)}
#: Per-expert weight names on disk: ``(gate, up, down)``.
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _stored_prefix(prefix: str, router: str, stored: Mapping[str, tuple[int, ...]]) -> str:
    """The block's name on disk: its own, or an older one the checkpoint's router is under."""
    parent, _, attr = prefix.rpartition(".")
    for name in (attr, *_STORED_BLOCK_NAMES.get(attr, ())):
        candidate = f"{parent}.{name}" if parent else name
        if f"{candidate}.{router}.weight" in stored:
            return candidate
    return prefix


def _has_correction_bias(moe: HFMoE) -> bool:
    """Whether the Hugging Face block ``moe`` stands for has a choice correction bias where its
    family keeps it (built on the meta device: no memory, no values)."""
    with torch.device("meta"):
        block = moe.new_block()
    return correction_bias(block, moe.family) is not None


def _ungated_sources(
    moe: HFMoE, src: str, stored: Mapping[str, tuple[int, ...]]
) -> dict[str, TensorSource]:
    """``w1`` / ``w2`` of experts that are not gated, fused or one by one on disk."""
    if f"{src}.experts.up_proj" in stored:
        return {
            w: TensorSource((f"{src}.experts.{name}",), transpose=True)
            for w, name in (("w1", "up_proj"), ("w2", "down_proj"))
        }
    experts = range(moe.num_experts)
    return {
        w: TensorSource(
            tuple(f"{src}.experts.{e}.{name}.weight" for e in experts), stacked=True, transpose=True
        )
        for w, name in (("w1", "up_proj"), ("w2", "down_proj"))
    }


def _expert_sources(
    moe: HFMoE, src: str, stored: Mapping[str, tuple[int, ...]]
) -> dict[str, TensorSource]:
    """``experts.*`` of ``moe`` (by their names inside the block) from the block ``src`` on disk."""
    layout = moe.family.layout
    if not moe.family.gated:
        return _ungated_sources(moe, src, stored)
    if f"{src}.experts.gate_up_proj" in stored or layout != "out_in":
        fused = f"{src}.experts.gate_up_proj"
        interleaved = layout == "interleaved"
        out_in = layout == "out_in"
        gate_up = {
            w: TensorSource((fused,), transpose=out_in, part=p, parts=2, interleaved=interleaved)
            for w, p in (("w1", 0), ("w3", 1))
        }
        sources = {**gate_up, "w2": TensorSource((f"{src}.experts.down_proj",), transpose=out_in)}
        if interleaved:
            bias = f"{fused}_bias"
            sources["b1"] = TensorSource((bias,), part=0, parts=2, interleaved=True)
            sources["b3"] = TensorSource((bias,), part=1, parts=2, interleaved=True)
            sources["b2"] = TensorSource((f"{src}.experts.down_proj_bias",))
        return sources
    names = next(
        (n for n in _PER_EXPERT_NAMES if f"{src}.experts.0.{n[0]}.weight" in stored),
        _PER_EXPERT_NAMES[0],
    )
    experts = range(moe.num_experts)
    return {
        w: TensorSource(
            tuple(f"{src}.experts.{e}.{name}.weight" for e in experts), stacked=True, transpose=True
        )
        for w, name in zip(("w1", "w3", "w2"), names, strict=True)
    }


def _block_sources(
    prefix: str, moe: HFMoE, stored: Mapping[str, tuple[int, ...]]
) -> dict[str, TensorSource]:
    """Every tensor of the converted block at ``prefix`` -> its source (renames included)."""
    family = moe.family
    src = _stored_prefix(prefix, family.weight_path, stored)
    router = f"{src}.{family.weight_path}"
    sources = {"router.gate.weight": TensorSource((f"{router}.weight",))}
    if moe.router.gate.bias is not None:
        sources["router.gate.bias"] = TensorSource((f"{router}.bias",))
    if _has_correction_bias(moe):
        sources["router.expert_bias"] = TensorSource((f"{src}.{family.correction_path}",))
    else:
        sources["router.expert_bias"] = TensorSource((), constant=0.0)
    sources.update({f"experts.{n}": s for n, s in _expert_sources(moe, src, stored).items()})
    sources.update(_kept_sources(moe, family, src))
    if family.shared_gate is not None:
        gate = TensorSource((f"{src}.{family.shared_gate}.weight",))
        sources["shared_expert_gate.weight"] = gate
    return {f"{prefix}.{name}" if prefix else name: s for name, s in sources.items()}


def _kept_sources(moe: HFMoE, family: _Family, src: str) -> dict[str, TensorSource]:
    """The tensors of the block's modules the layer keeps as they are (shared expert, output
    norm, latent projections) and of its hash table, from their names in the block on disk."""
    sources = {}
    for attr, path in kept_paths(family).items():
        module = kept_module(moe, attr)
        if module is not None:
            for name in module.state_dict():
                sources[f"{attr}.{name}"] = TensorSource((f"{src}.{path}.{name}",))
    if family.hash_table and moe.expert_table is not None:
        sources["expert_table"] = TensorSource((f"{src}.{family.hash_table}",))
    return sources


def hf_checkpoint_sources(
    model: nn.Module, stored: Mapping[str, tuple[int, ...]]
) -> dict[str, TensorSource]:
    """For each tensor of ``model``'s converted MoE blocks (:class:`HFMoE`, by its state-dict
    name) that the Hugging Face checkpoint whose tensors are ``stored`` (name -> shape, e.g.
    ``forge_checkpoint.hf_weight_shapes``) does not hold under its own name: where it is read
    from. Empty for a model without converted blocks. The model may be on the meta device or
    sharded (only names and the blocks' configs are read); whether the stored tensors exist and
    have the shapes the sources need is for the reader's checks to say.
    """
    sources: dict[str, TensorSource] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, HFMoE):
            sources.update(_block_sources(prefix, module, stored))
    return {name: s for name, s in sources.items() if s.rename != name}
