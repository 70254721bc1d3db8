"""What forge does to a Hugging Face model before and around its stages (used by
:class:`forge.build.ParallelPlan`; transformers itself is never imported here).

Provides:

- :func:`prepare_hf`: before the stages, convert Hugging Face MoE blocks to forge's MoE when
  tp or ep > 1, and declare a Hugging Face VLM's parts as components
  (:func:`declare_hf_vlm_components`);
- :func:`no_kv_cache_under_ac`: the KV cache off before AC wraps the model;
- :func:`apply_packed_sequences`: the ``packed_sequences`` setting, as hooks on
  transformers' packed-sequence check (:mod:`forge.hf_patches`);
- :func:`init_hf_weights`: a model materialized from the meta device filled as transformers
  initializes it, the same values however it is sharded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
import torch.nn as nn
from forge_core import ForgeConfigError
from forge_core.contracts import declare_components, declared_components
from forge_core.init import copy_full_, param_seed
from forge_core.mesh_dims import axis_size
from forge_fsdp_wrap.blocks import find_block_container
from forge_moe_ep.hf import HFMoE, convert_hf_moe, hf_block_values
from torch.distributed.device_mesh import DeviceMesh

from .hf_patches import (
    HOOKS_ATTR,
    is_hf_model,
    is_hf_pretrained,
    is_packed_sequence_patched,
    skip_packed_sequence_check,
)

__all__ = [
    "apply_packed_sequences",
    "declare_hf_vlm_components",
    "no_kv_cache_under_ac",
    "prepare_hf",
]

logger = logging.getLogger(__name__)


def prepare_hf(model: nn.Module, mesh: DeviceMesh | None) -> bool:
    """A Hugging Face model's preparation before the stages; whether the whole model is
    transformers' (not just a part)."""
    if is_hf_model(model) and max(axis_size(mesh, "tp"), axis_size(mesh, "ep")) > 1:
        # NOTE: before TP: Hugging Face MoE blocks cannot run sharded under forge (their
        # plans' expert styles are transformers' own); forge's MoE runs whole on each tp
        # rank and shards its experts over ep. forge_moe_ep.hf.restore_hf_moe undoes it.
        converted = convert_hf_moe(model)
        if converted:
            logger.info("Hugging Face MoE blocks converted to forge's MoE: %s", converted)
    hf = is_hf_pretrained(model)
    if hf:
        declare_hf_vlm_components(model)
    return hf


#: A Hugging Face vision-language model's parts (``LlavaForConditionalGeneration``,
#: ``Gemma3ForConditionalGeneration`` and the many built the same way).
_HF_VLM_PARTS = {
    "encoder": "model.vision_tower",
    "adapter": "model.multi_modal_projector",
    "decoder": "model.language_model",
}


def declare_hf_vlm_components(model: nn.Module) -> None:
    """Declare a Hugging Face VLM's parts as components (forge_core.contracts), so FSDP2, AC and
    compile treat each on its own: the vision tower's blocks, the projector and the language
    model's blocks become FSDP2 units (without it they would all sit in the root unit).

    NOTE: the encoder and decoder components are the towers' BLOCK containers, not the towers:
    the VLM looks up the token embeddings itself before calling its language model (an FSDP2
    unit of the language model would not be gathered for that lookup), and a unit of the vision
    tower (a transformers PreTrainedModel) stops transformers from collecting the tower's hidden
    states (Llava reads them). Embeddings, norms and the head stay with the root unit.
    """
    if declared_components(model):
        return
    present = {}
    for name, path in _HF_VLM_PARTS.items():
        try:
            part = model.get_submodule(path)
        except AttributeError:
            continue
        if name != "adapter":
            try:
                blocks = find_block_container(part)
            except ForgeConfigError:
                return
            path = next(n for n, m in model.named_modules() if m is blocks)
        present[name] = path
    if "encoder" in present and "decoder" in present:
        declare_components(model, present)


def no_kv_cache_under_ac(model: nn.Module, ac_mode: str) -> None:
    """Turn off a Hugging Face model's KV cache (``config.use_cache``) before AC wraps it.

    NOTE: with transformers' default ``use_cache=True`` a training forward still builds a KV
    cache, which AC's recomputation does not reproduce: op AC fails in backward ("aten.slice.Tensor
    invocation ... not found in storage"), full AC recomputes against a grown cache. transformers'
    own gradient checkpointing turns the cache off the same way.
    """
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False  # type: ignore[union-attr]
            logger.info(
                "ac_mode=%s: %s.config.use_cache set to False (AC recomputes the forward; a KV "
                "cache built in it would not be reproduced)",
                ac_mode,
                name or type(module).__name__,
            )


def apply_packed_sequences(model: nn.Module, packed_sequences: bool | None) -> None:
    """Hook a Hugging Face model as ``ParallelPlan.packed_sequences`` allows (see its
    docstring): ``None`` leaves it alone, ``True`` refuses a model hooked to skip
    transformers' packed-sequence check, ``False`` hooks it (no host sync per layer)."""
    if packed_sequences is None or not is_hf_model(model):
        return
    if packed_sequences:
        if getattr(model, HOOKS_ATTR, None) or is_packed_sequence_patched():
            raise ForgeConfigError(
                "packed_sequences=True, but this model is hooked to skip transformers' "
                "packed-sequence check (a plan with packed_sequences=False parallelized it, "
                "or it runs inside forge.hf_patches.no_packed_sequence_sync): packed rows "
                "would attend across sequences; call "
                "forge.hf_patches.restore_packed_sequence_check(model) first"
            )
        return
    if skip_packed_sequence_check(model):
        logger.info(
            "packed_sequences=False: transformers' packed-sequence check returns False while "
            "this model runs (no host sync per attention layer)"
        )
    else:
        logger.info("packed_sequences=False: this transformers has no such check; no hooks")


def _owned_modules(
    module: nn.Module, prefix: str = "", owner: nn.Module | None = None
) -> Iterator[tuple[str, nn.Module, nn.Module | None]]:
    """Every module after its children (``fqn``, module, the Hugging Face model whose
    ``_init_weights`` initializes it: the nearest one enclosing it), as transformers visits
    them. A converted MoE block (forge's ``HFMoE``) is one module: its insides are forge's."""
    if callable(getattr(module, "_init_weights", None)) and hasattr(module, "config"):
        owner = module
    if not isinstance(module, HFMoE):
        for name, child in module.named_children():
            yield from _owned_modules(child, f"{prefix}{name}.", owner)
    yield prefix.rstrip("."), module, owner


def _init_converted_moe(
    moe: HFMoE, fqn: str, owner: nn.Module, seed: int, *, parameters: bool
) -> None:
    """Fill a converted MoE block as the Hugging Face block it replaced would be filled: a
    stand-in block initialized module by module with the seeds the unconverted model's modules
    get (by their names under ``fqn``), converted, each rank keeping its slices. Without
    ``parameters`` (weights about to be loaded), only its buffers: a new block's are zeros
    (the balancing bias and the routing counters)."""
    if not parameters:
        for buffer in moe.buffers():
            buffer.zero_()
        return

    def init(block: nn.Module) -> None:
        for name, module, _ in _owned_modules(block, f"{fqn}.", owner):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(param_seed(seed, name))
                owner._init_weights(module)  # type: ignore[operator]

    values = hf_block_values(moe, init)
    for name, tensor in moe.state_dict(keep_vars=True).items():
        copy_full_(tensor, values[name].to(tensor.dtype))


@torch.no_grad()
def init_hf_weights(model: nn.Module, seed: int, *, parameters: bool = True) -> None:
    """Fill a Hugging Face model just allocated from the meta device as transformers initializes
    one, the same values however it is sharded: each module by its model's own
    ``_init_weights`` (normal, zeros, ones by module type; a padding row zeroed; rotary
    frequencies and other buffers no checkpoint holds recomputed from the config), on whole
    stand-in tensors drawn from a generator seeded by ``(seed, module name)``; each rank then
    keeps its slice of each (``forge_core.init.copy_full_``). One module's tensors at a time
    exist whole. A parameter two modules share (a tied head) is filled by the first.

    ``parameters=False`` (weights about to be loaded): the stand-ins live on the meta device
    and nothing is copied, so only the buffers are computed and the parameters stay as
    allocated, for ``load_hf_weights`` to fill.
    """
    # NOTE: to_empty() from the meta device gives each module its own new parameter, which
    # unties a tied head on one device: tie again first (as transformers does after loading).
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    done: set[int] = set()
    for fqn, module, owner in _owned_modules(model):
        if owner is None:
            continue
        if isinstance(module, HFMoE):
            _init_converted_moe(module, fqn, owner, seed, parameters=parameters)
            continue
        # NOTE: every parameter gets a stand-in, those filled already (a tied head) too: the
        # init must never write into a real one (a DTensor would take the same values on every
        # rank); only the first fill of a parameter is kept.
        params = list(module.named_parameters(recurse=False))
        where = "cpu" if parameters else "meta"
        for name, param in params:
            stand_in = torch.empty(param.shape, dtype=param.dtype, device=where)
            setattr(module, name, nn.Parameter(stand_in))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(param_seed(seed, fqn or "model"))
            owner._init_weights(module)  # type: ignore[operator]
        for name, param in params:
            full = getattr(module, name)
            setattr(module, name, param)
            if parameters and id(param) not in done:
                copy_full_(param, full.detach())
                done.add(id(param))
