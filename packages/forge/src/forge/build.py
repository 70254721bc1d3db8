"""Composition: apply forge's layers to a model in the one correct order.

    mesh -> model on meta -> TP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2 -> materialize
                                                            (DDP: materialize -> DDP)

EP runs whenever the model has MoE layers and a mesh: with
an ``ep`` axis it shards the experts, without one it only tells the MoE layers their
data-parallel group (token counts for load balancing are summed over it).

A vision-language model (``forge_vlm.VLMWrapper``: components encoder, adapter, decoder) goes
through the same order, per component: TP on the decoder (its plan, SP) and optionally on the
encoder (its own plan, no SP) -> EP and Float8 on the decoder -> AC on the components
``ac_scope`` names ->
compile every component's blocks -> FSDP2 units encoder blocks, encoder, adapter, decoder
blocks, decoder, root (a frozen encoder may stay replicated instead; see
``forge_fsdp_wrap.apply_fsdp2``). The stage-order contract checks each component.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core import ForgeConfigError, ModelConfig
from forge_core.contracts import model_components
from forge_core.mesh_dims import axis_size, get_dp_mesh, has_dp_mesh
from forge_domain import apply_domain_parallel
from forge_float8 import apply_float8
from forge_fsdp_wrap import (
    AC_MODES,
    apply_ac,
    apply_compile,
    apply_ddp,
    apply_fsdp2,
    default_mp_policy,
    enable_autocast,
)
from forge_moe_ep import MoE, apply_expert_parallel, moe_transformer
from forge_tp_plans import apply_tensor_parallel
from forge_vlm import (
    AdapterConfig,
    VisionEncoderConfig,
    VLMConfig,
    ac_components,
    build_vlm,
    check_encoder_tp,
    check_vlm,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

__all__ = ["ParallelPlan", "build_parallel_model", "check_plan", "materialize"]

#: Axes whose layer this forge does not have yet -> what provides them. Refused, never ignored.
NOT_YET = {
    "cp": "context parallelism",
    "pp": "pipeline parallelism",
}


def check_plan(
    data: str,
    axis_sizes: dict[str, int],
    *,
    ac_mode: str = "none",
) -> None:
    """Refuse what this forge cannot do, before any process group exists (pure checks)."""
    if data not in ("fsdp2", "ddp", "none"):
        raise ForgeConfigError(f"data={data!r}: choose 'fsdp2', 'ddp' or 'none'")
    for axis, layer in NOT_YET.items():
        if axis_sizes.get(axis, 1) > 1:
            raise ForgeConfigError(
                f"parallelism.{axis}={axis_sizes[axis]} needs {layer}, which this forge does not have yet; set {axis}=1"
            )
    if data == "ddp" and axis_sizes.get("tp", 1) > 1:
        raise ForgeConfigError(
            f"data='ddp' with tp={axis_sizes['tp']}: DDP does not handle tensor-parallel (DTensor) "
            "parameters; use data='fsdp2' (FSDP2 shards them on the dp axis: 2-D)"
        )
    if ac_mode not in AC_MODES:
        raise ForgeConfigError(f"ac_mode={ac_mode!r} is invalid: choose one of {list(AC_MODES)}")


@dataclass
class ParallelPlan:
    """How to parallelize a model over ``device_mesh``; :meth:`parallelize` applies it.

    ``data``: ``fsdp2`` | ``ddp`` | ``none``; None picks ``fsdp2`` when the mesh has a DP axis.
    ``param_dtype`` is the compute dtype; parameters (master weights) stay float32 in every mode.
    FSDP2 gets it through ``default_mp_policy`` (ignored when ``mp_policy`` is given); DDP and
    ``none`` run the forward under ``torch.autocast(param_dtype)`` (see ``enable_autocast``).
    """

    device_mesh: DeviceMesh | None
    data: str | None = None
    ac_mode: str = "none"
    compile_model: bool = False
    compile_backend: str = "inductor"
    mp_policy: MixedPrecisionPolicy | None = None
    param_dtype: torch.dtype = torch.bfloat16
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    fp8: bool = False
    fp8_recipe: str = "tensorwise"
    fp8_fsdp_all_gather: bool | None = None
    fp8_filter_fqns: Sequence[str] = ()
    tp_plan: Mapping[str, object] | str | None = None
    sequence_parallel: bool | None = None
    loss_parallel: bool = False
    allow_plan_import: bool | Sequence[str] = False
    encoder_tp: bool = False
    encoder_tp_plan: Mapping[str, object] | str | None = None
    ac_components: Sequence[str] | None = None
    shard_frozen: bool | None = None

    def __post_init__(self) -> None:
        sizes = {axis: axis_size(self.device_mesh, axis) for axis in (*NOT_YET, "tp", "domain")}
        if self.data is None:
            self.data = "fsdp2" if has_dp_mesh(self.device_mesh) else "none"
        check_plan(
            self.data,
            sizes,
            ac_mode=self.ac_mode,
        )
        if self.data == "fsdp2" and not has_dp_mesh(self.device_mesh):
            raise ForgeConfigError("data='fsdp2' needs a mesh with a data-parallel axis")

    @property
    def fp8_all_gather(self) -> bool:
        """FSDP2's fp8 all-gather: as asked, or (None) on for tensorwise FSDP2 without TP on NCCL.

        NOTE: off by default on gloo: an FSDP2 unit holding only fp8 weights all-gathers in a
        float8 dtype, which gloo cannot move (units with mixed dtypes all-gather bytes and work).
        """
        if self.fp8_fsdp_all_gather is not None:
            return self.fp8_fsdp_all_gather
        if self.data != "fsdp2" or self.fp8_recipe != "tensorwise":
            return False
        if axis_size(self.device_mesh, "tp") > 1:
            return False
        group = get_dp_mesh(self.device_mesh).get_group(0)  # type: ignore[arg-type]
        return dist.get_backend(group) != "gloo"

    def parallelize(
        self, model: nn.Module, *, device: torch.device | str | None = None, seed: int | None = None
    ) -> nn.Module:
        """Apply the plan to ``model`` in order; with ``device``, materialize on it from ``seed``.

        A model on the meta device is materialized with ``to_empty(device)`` + ``init_weights(seed)``
        (after FSDP2, so each rank allocates only its shard; before DDP, which needs values).
        Returns the model (the DDP wrapper for ``data='ddp'``).

        A model made of components (a VLM) gets TP on its ``decoder`` (and on its ``encoder``
        with ``encoder_tp``), EP and Float8 on the decoder, AC on ``ac_components`` (None: all).
        """
        parts = dict(model_components(model))
        decoder, encoder = parts.get("decoder", model), parts.get("encoder")
        if self.encoder_tp and encoder is None:
            raise ForgeConfigError(
                f"encoder_tp=True but {type(model).__name__} has no encoder component"
            )
        if axis_size(self.device_mesh, "tp") > 1:
            apply_tensor_parallel(
                decoder,
                self.device_mesh,
                plan=self.tp_plan,
                sequence_parallel=self.sequence_parallel,
                loss_parallel=self.loss_parallel,
                allow_import=self.allow_plan_import,
            )
            if self.encoder_tp:
                if isinstance(getattr(encoder, "config", None), VisionEncoderConfig):
                    check_encoder_tp(encoder.config, axis_size(self.device_mesh, "tp"))
                apply_tensor_parallel(
                    encoder,
                    self.device_mesh,
                    plan=self.encoder_tp_plan,
                    sequence_parallel=False,
                    allow_import=self.allow_plan_import,
                )
        if self.device_mesh is not None and any(isinstance(m, MoE) for m in decoder.modules()):
            apply_expert_parallel(decoder, self.device_mesh)
        elif axis_size(self.device_mesh, "ep") > 1:
            raise ForgeConfigError(
                "the mesh has an ep axis but the model has no forge_moe_ep.MoE layer; set "
                "parallelism.ep=1 or use an MoE model (model.moe_every > 0)"
            )
        if self.fp8:  # a VLM's decoder; its encoder and adapter stay in high precision
            apply_float8(
                decoder,
                recipe=self.fp8_recipe,
                enable_fsdp_float8_all_gather=self.fp8_all_gather,
                filter_fqns=tuple(self.fp8_filter_fqns),
            )
        if axis_size(self.device_mesh, "domain") > 1:
            apply_domain_parallel(model, self.device_mesh)
        if self.ac_mode != "none":
            components = None if self.ac_components is None else tuple(self.ac_components)
            apply_ac(model, self.ac_mode, components=components)
        if self.compile_model:
            apply_compile(model, backend=self.compile_backend)
        if self.data == "fsdp2":
            mp = self.mp_policy or default_mp_policy(self.param_dtype)
            apply_fsdp2(
                model,
                self.device_mesh,
                mp,
                self.reshard_after_forward,
                self.cpu_offload,
                shard_frozen=self.shard_frozen,
            )
        if device is not None:
            # NOTE: with CPU offload the sharded parameters live on the CPU (FSDP2 copies them to
            # the device per unit); buffers are not managed by FSDP2 and must be on the device.
            param_device = "cpu" if self.cpu_offload and self.data == "fsdp2" else device
            materialize(model, device, seed or 0, param_device=param_device)
            for part in parts.values():  # a component left out of FSDP2 computes on the device
                if param_device != device and not isinstance(part, FSDPModule):
                    part.to(device)
        if self.data in ("ddp", "none") and self.param_dtype != torch.float32:
            enable_autocast(model, self.param_dtype)
        if self.data == "ddp":
            return apply_ddp(model, self.device_mesh)
        return model


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device | str,
    seed: int,
    *,
    param_device: torch.device | str | None = None,
) -> nn.Module:
    """Allocate a meta-device model and fill it deterministically from ``seed``.

    Parameters go to ``param_device`` (default ``device``), buffers to ``device``.
    """
    if not callable(getattr(model, "init_weights", None)):
        raise ForgeConfigError(
            f"{type(model).__name__} has no init_weights(seed); materialize it yourself"
        )
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to_empty(device=param_device or device)
    model.init_weights(seed)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.device != torch.device(device):
                module.register_buffer(
                    name, buf.to(device), persistent=name not in module._non_persistent_buffers_set
                )
    return model


def build_parallel_model(
    model_config: ModelConfig,
    device: torch.device | str,
    device_mesh: DeviceMesh | None,
    *,
    vision_config: VisionEncoderConfig | None = None,
    adapter_config: AdapterConfig | None = None,
    vlm_config: VLMConfig | None = None,
    ac_mode: str = "none",
    mp_policy: MixedPrecisionPolicy | None = None,
    param_dtype: torch.dtype = torch.bfloat16,
    compile_model: bool = False,
    compile_backend: str = "inductor",
    fp8: bool = False,
    fp8_recipe: str = "tensorwise",
    fp8_fsdp_all_gather: bool | None = None,
    fp8_filter_fqns: Sequence[str] = (),
    data: str | None = None,
    seed: int = 0,
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    tp_plan: Mapping[str, object] | str | None = None,
    sequence_parallel: bool | None = None,
    loss_parallel: bool = False,
    allow_plan_import: bool | Sequence[str] = False,
) -> nn.Module:
    """Build the reference Transformer (or a VLM) on the meta device, parallelize, materialize.

    The pipeline, top to bottom: model on meta -> TP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2
    -> materialize (``to_empty`` + ``init_weights(seed)``: identical values to a single-device
    model built with the same seed). ``device_mesh=None`` builds a plain single-device model.

    With ``vlm_config`` (and ``vision_config``, ``adapter_config``) the model is a
    ``forge_vlm.VLMWrapper`` whose decoder is ``model_config``; ``vlm_config`` says whether the
    encoder is frozen, TP-split (its own plan) and which components AC covers (``ac_scope``).
    """
    vlm_parts = (vision_config, adapter_config, vlm_config)
    if any(p is not None for p in vlm_parts) and any(p is None for p in vlm_parts):
        raise ForgeConfigError(
            "a vision-language model needs vision_config, adapter_config and vlm_config together"
        )
    vlm_options: dict[str, Any] = {}
    if vlm_config is not None:
        check_vlm(model_config, vision_config, adapter_config, vlm_config)  # TP: parallelize
        vlm_options = {
            "encoder_tp": vlm_config.encoder_tp,
            "encoder_tp_plan": vlm_config.encoder_tp_plan,
            "ac_components": ac_components(vlm_config.ac_scope, vlm_config.freeze_encoder)
            if ac_mode != "none"
            else None,
            "shard_frozen": vlm_config.shard_frozen_flag,
        }
    plan = ParallelPlan(
        device_mesh,
        data=data,
        ac_mode=ac_mode,
        compile_model=compile_model,
        compile_backend=compile_backend,
        mp_policy=mp_policy,
        param_dtype=param_dtype,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
        fp8=fp8,
        fp8_recipe=fp8_recipe,
        fp8_fsdp_all_gather=fp8_fsdp_all_gather,
        fp8_filter_fqns=fp8_filter_fqns,
        tp_plan=tp_plan,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        allow_plan_import=allow_plan_import,
        **vlm_options,
    )
    with torch.device("meta"):
        if vlm_config is None:
            model = moe_transformer(model_config)
        else:
            factory = MoE.for_block if model_config.moe_layers else None
            model = build_vlm(
                model_config, vision_config, adapter_config, vlm_config, ffn_factory=factory
            )
    return plan.parallelize(model, device=device, seed=seed)
