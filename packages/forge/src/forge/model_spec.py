"""What forge's stages need to know about one model, found once before the stages.

:class:`ModelSpec` is the one place that tells model kinds apart for
:class:`forge.build.ParallelPlan`, which then runs its stages on the spec's modules without
asking what the model is:

- ``"hf"``: a Hugging Face model (a ``transformers`` ``PreTrainedModel``, VLMs included). It is
  prepared first (:func:`forge.hf_prepare.prepare_hf`: MoE blocks converted, components
  declared), and TP applies its own ``_tp_plan`` to the whole model: a Hugging Face VLM's plan
  names ``model.language_model.*`` and ``lm_head``, which lies outside the language model.
- ``"components"``: a model made of components (``forge_vlm.VLMWrapper``, or any model that
  declares them): TP, EP and Float8 on its ``decoder``; with ``vlm.encoder_tp`` also TP on its
  ``encoder``, with the encoder's own plan and no sequence parallelism.
- ``"model"``: anything else (forge's Transformer, dense or MoE, a field model, your own):
  every stage on the model itself.

Also here, because they depend on how a model holds its values: :func:`materialize` (a model on
the meta device filled from a seed) and the refusal to re-initialize a model that has values.

Provides :class:`ModelSpec`, :func:`model_spec`, :func:`materialize`,
:func:`refuse_materialized`, and :func:`load_pipeline_weights` (a Hugging Face directory's
weights read into pipeline stages: each pipeline rank reads its stages' tensors only).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from forge_checkpoint import hf_weight_shapes, load_hf_weights
from forge_core import ForgeConfigError
from forge_core.contracts import declared_components, model_components
from forge_core.mesh_dims import axis_size
from forge_core.tensor_source import TensorSource
from forge_core.torch_compat import non_persistent_buffer_names
from forge_moe_ep import HFMoE, MoE, apply_expert_parallel
from forge_moe_ep.hf_sources import hf_checkpoint_sources
from forge_tp_plans import apply_tensor_parallel
from forge_vlm import VisionEncoderConfig, VLMConfig, check_encoder_tp
from forge_vlm import ac_components as vlm_ac_components
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import ParallelStyle

from .hf_prepare import apply_packed_sequences, init_hf_weights, prepare_hf

__all__ = [
    "ModelSpec",
    "ac_components",
    "hf_weight_sources",
    "load_pipeline_weights",
    "materialize",
    "model_spec",
    "refuse_materialized",
    "shard_frozen",
    "weights_call_problems",
]

TPPlan = Mapping[str, ParallelStyle | str | None] | str | None


@dataclass(frozen=True)
class ModelSpec:
    """One model as the stages see it: its kind, the module TP's plan is written for, the
    module EP and Float8 apply to (``decoder``), the encoder a VLM may split, and its
    components (each moved to the device when it stays out of FSDP2)."""

    kind: str
    model: nn.Module
    decoder: nn.Module
    encoder: nn.Module | None
    parts: tuple[nn.Module, ...]

    @property
    def tp_target(self) -> nn.Module:
        """What the TP plan applies to: the whole model for Hugging Face, else the decoder."""
        return self.model if self.kind == "hf" else self.decoder

    def tensor_parallel(
        self,
        mesh: DeviceMesh,
        *,
        plan: TPPlan,
        sequence_parallel: bool | None,
        loss_parallel: bool,
        allow_import: bool | Sequence[str],
        vlm: VLMConfig | None,
    ) -> None:
        """TP on :attr:`tp_target` and, with ``vlm.encoder_tp``, on the encoder (its own plan)."""
        apply_tensor_parallel(
            self.tp_target,
            mesh,
            plan=plan,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            allow_import=allow_import,
        )
        if vlm is not None and vlm.encoder_tp and self.encoder is not None:
            encoder_config = getattr(self.encoder, "config", None)
            if isinstance(encoder_config, VisionEncoderConfig):
                check_encoder_tp(encoder_config, axis_size(mesh, "tp"))
            apply_tensor_parallel(
                self.encoder,
                mesh,
                plan=vlm.encoder_tp_plan,
                sequence_parallel=False,
                allow_import=allow_import,
            )

    def expert_parallel(self, mesh: DeviceMesh | None, *, expert_tp: bool = False) -> None:
        """EP on the decoder's MoE layers (``expert_tp``: their experts split over tp too); an
        ep axis without one is refused (by forge-moe-ep)."""
        has_moe = any(isinstance(m, MoE) for m in self.decoder.modules())
        if mesh is not None and (has_moe or axis_size(mesh, "ep") > 1):
            apply_expert_parallel(self.decoder, mesh, expert_tp=expert_tp)

    def materialize(
        self,
        device: torch.device | str,
        seed: int,
        *,
        param_device: torch.device | str,
        weights: str | os.PathLike[str] | None = None,
    ) -> None:
        """:func:`materialize` the model (a Hugging Face model by its own init rules; with
        ``weights``, its buffers only, then the directory's weights loaded sharded); a component
        left out of FSDP2 then computes on ``device`` even when the sharded parameters live on
        ``param_device`` (CPU offload)."""
        if weights is not None and self.kind != "hf":
            raise ForgeConfigError(
                f"parallelize(weights={str(weights)!r}) loads a Hugging Face model's weights, but "
                f"this is a {type(self.model).__name__}: build the model from the directory's "
                "config.json (transformers' AutoModelForCausalLM.from_config on the meta device)"
            )
        init = None
        if self.kind == "hf":
            init = partial(init_hf_weights, self.model, parameters=weights is None)
        materialize(self.model, device, seed, param_device=param_device, init=init)
        if weights is not None:
            load_hf_weights(self.model, weights, sources=hf_weight_sources(self.model, weights))
        for part in self.parts:
            if param_device != device and not isinstance(part, FSDPModule):
                part.to(device)


def hf_weight_sources(model: nn.Module, weights: str | os.PathLike[str]) -> dict[str, TensorSource]:
    """Where the tensors of ``model``'s converted MoE blocks (forge_moe_ep's ``HFMoE``, put in
    by :func:`forge.hf_prepare.prepare_hf` when tp or ep > 1) lie in the Hugging Face directory
    ``weights`` (forge_moe_ep knows the layouts; forge_checkpoint reads them): the ``sources``
    of ``load_hf_weights`` and ``hf_weight_problems``. Empty, and no file read, for a model
    without converted blocks."""
    if not any(isinstance(m, HFMoE) for m in model.modules()):
        return {}
    return hf_checkpoint_sources(model, hf_weight_shapes(weights))


def load_pipeline_weights(model: nn.Module, weights: str | os.PathLike[str]) -> None:
    """Fill a pipeline rank's model (what ``ParallelPlan.parallelize`` returns at pp > 1: this
    rank's stages under the unsplit Hugging Face names, parallelized and materialized) from the
    Hugging Face directory ``weights``, reading only the tensors this rank holds (its own slices
    of them under TP, EP, FSDP2).

    Collective: every rank calls it. The whole model, every rank's part together, is checked
    against the files first: a stored tensor that another pipeline rank holds is no error here,
    one that no rank holds, or one a rank needs and the files lack, is refused on every rank
    with one line (``forge_checkpoint.load_hf_weights(..., partial=True)``)."""
    load_hf_weights(model, weights, sources=hf_weight_sources(model, weights), partial=True)


def model_spec(
    model: nn.Module,
    mesh: DeviceMesh | None,
    *,
    vlm: VLMConfig | None = None,
    packed_sequences: bool | None = None,
) -> ModelSpec:
    """Prepare ``model`` for the stages (a Hugging Face model's conversion and hooks) and say
    what it is. Refuses ``vlm.encoder_tp`` on a model without an encoder component."""
    apply_packed_sequences(model, packed_sequences)
    hf = prepare_hf(model, mesh)
    parts = dict(model_components(model))
    encoder = parts.get("encoder")
    no_encoder = encoder is None and "encoder" not in declared_components(model)
    if vlm is not None and vlm.encoder_tp and no_encoder:
        raise ForgeConfigError(
            f"encoder_tp=True but {type(model).__name__} has no encoder component"
        )
    kind = "hf" if hf else "components" if parts else "model"
    return ModelSpec(kind, model, parts.get("decoder", model), encoder, tuple(parts.values()))


def weights_call_problems(
    weights: str | os.PathLike[str] | None, device: torch.device | str | None
) -> list[str]:
    """What refuses ``parallelize(weights=...)``: no ``device`` (the model is filled after it is
    allocated there from the meta device)."""
    if weights is not None and device is None:
        return ["parallelize(weights=...) fills a model built on the meta device: pass device= too"]
    return []


def refuse_materialized(model: nn.Module, device: torch.device | str) -> None:
    """``parallelize(device=...)`` initialises a meta model from the seed; refuse a model that
    already holds values (they would be silently re-initialised)."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ForgeConfigError(
            f"parallelize(device={str(device)!r}) materializes a model on the meta device from "
            f"a seed, but this {type(model).__name__} already holds its values (they would be "
            "re-initialized); call parallelize(model) without device, after moving the model "
            "to its device"
        )


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device | str,
    seed: int,
    *,
    param_device: torch.device | str | None = None,
    init: Callable[[int], None] | None = None,
) -> nn.Module:
    """Allocate a meta-device model and fill it deterministically from ``seed``: with ``init``
    (called with the seed) or the model's own ``init_weights(seed)``.

    Parameters go to ``param_device`` (default ``device``), buffers to ``device``.
    """
    init_weights = init or getattr(model, "init_weights", None)
    if not callable(init_weights):
        raise ForgeConfigError(
            f"{type(model).__name__} has no init_weights(seed); materialize it yourself"
        )
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to_empty(device=param_device or device)  # in place: init_weights stays bound to it
    init_weights(seed)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.device != torch.device(device):
                module.register_buffer(
                    name, buf.to(device), persistent=name not in non_persistent_buffer_names(module)
                )
    return model


def ac_components(vlm: VLMConfig | None, ac_mode: str) -> tuple[str, ...] | None:
    """The components AC covers: a VLM's ``vlm.ac_scope``; None (all) for other models.

    NOTE: resolved only when AC is on: ``forge_vlm.ac_components`` refuses some scopes (vision
    with a frozen encoder) that do not matter without AC.
    """
    if vlm is None or ac_mode == "none":
        return None
    return vlm_ac_components(vlm.ac_scope, vlm.freeze_encoder)


def shard_frozen(vlm: VLMConfig | None) -> bool | None:
    """FSDP2's ``shard_frozen`` (forge_fsdp_wrap.apply_fsdp2): a VLM's
    ``vlm.shard_frozen_encoder`` (None: decide by size); None for other models."""
    return None if vlm is None else vlm.shard_frozen_flag
