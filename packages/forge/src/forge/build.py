"""Composition: apply forge's layers to a model in the one correct order.

    mesh -> model on meta -> TP -> CP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2 -> materialize
                                                            (DDP: materialize -> DDP)

EP runs whenever the model has MoE layers and a mesh: with an ``ep`` axis it shards the experts
and installs the token dispatch hooks; either way each MoE layer gets a load hook that sums its
token counts over the data-parallel ranks (load balancing). The layers hold no process group.

A vision-language model (components encoder, adapter, decoder) goes through the same order per
component (:class:`forge.model_spec.ModelSpec` says which stage applies where); the stage-order
contract checks each component. :meth:`ParallelPlan.from_config` is the one mapping from a
``ForgeConfig`` to a plan (``forge build`` and ``forge train`` use it; see :class:`ParallelPlan`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core import ForgeConfigError, ModelConfig
from forge_core.errors import did_you_mean, refuse
from forge_core.mesh_dims import axis_size, has_dp_mesh
from forge_cp import CPConfig, apply_context_parallel
from forge_cp.checks import cp_pipeline_problems
from forge_domain import apply_domain_parallel
from forge_float8 import Float8Config, apply_float8
from forge_fsdp_wrap import (
    apply_ac,
    apply_compile,
    apply_ddp,
    apply_fsdp2,
    compile_after_sharding,
    default_mp_policy,
    enable_autocast,
)
from forge_mesh import check_mesh_matches
from forge_pp import PipelineSplit, attach_schedule, pipeline_split, share_buffers
from forge_pp.checks import stages_per_rank_problems
from forge_pp.config import PPConfig
from forge_tp_plans.checks import pipeline_stage_problems
from forge_vlm import AdapterConfig, VisionEncoderConfig, VLMConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from .checks import check_float8, check_plan
from .config import COMPILE_SCOPES, ForgeConfig, as_config
from .config_fields import config_fields
from .hf_prepare import no_kv_cache_under_ac
from .hf_source import hf_compile_problems
from .layout import Layout, resolve_layout
from .model_spec import (
    ac_components,
    load_pipeline_weights,
    materialize,
    model_spec,
    refuse_materialized,
    shard_frozen,
    weights_call_problems,
)
from .models import build_meta_model, model_from_config

__all__ = [
    "model_from_config",
    "ParallelPlan",
    "build_meta_model",
    "build_parallel_model",
    "check_float8",
    "check_plan",
    "materialize",
]

logger = logging.getLogger(__name__)
Device = torch.device | str
Weights = str | Path | None


def _ranks_device_type(mesh: DeviceMesh | None) -> str:
    """ "cpu" for gloo ranks (or one device), else "cuda": what a layout's backend-dependent
    decisions (the fp8 all-gather) need. ``forge plan``'s fake ranks plan GPUs."""
    if mesh is None:
        return "cpu"
    return "cpu" if dist.get_backend(mesh.get_group(0)) == "gloo" else "cuda"


@dataclass(frozen=True)
class ParallelPlan:
    """How to parallelize a model over ``device_mesh``; :meth:`parallelize` applies it.

    Build one directly (``ParallelPlan(mesh, data="fsdp2", ...)``: every field after the mesh is
    a keyword) or from a config with :meth:`from_config` (exactly what ``forge build`` runs).
    Then::

        model = plan.maybe_compile(plan.parallelize(model))

    A plan is frozen: :func:`dataclasses.replace` makes a changed copy (checked again).

    ``data``: ``fsdp2`` | ``ddp`` | ``none``; None picks ``fsdp2`` when the mesh has a DP axis
    (:attr:`data_mode` is the mode applied).
    ``param_dtype`` is the compute dtype; parameters (master weights) stay float32 in every mode.
    FSDP2 gets it through ``default_mp_policy`` (ignored when ``mp_policy`` is given); DDP and
    ``none`` run the forward under ``torch.autocast(param_dtype)`` (see ``enable_autocast``).

    ``float8`` is forge-float8's own ``[float8]`` section (``Float8Config``): Float8 on the
    decoder when ``enabled``. ``vlm`` is forge-vlm's ``[vlm]`` section (``VLMConfig``) for a
    model made of components: TP on the encoder (``encoder_tp``, ``encoder_tp_plan``), which
    components AC covers (``ac_scope``), whether a frozen encoder is sharded
    (``shard_frozen_encoder``). Both are read as they are: no renamed copies of their fields.

    ``compile_model`` turns ``torch.compile`` on; ``compile_scope`` says where: ``"blocks"``
    (default): :meth:`parallelize` compiles each block after AC and before FSDP2
    (``forge_fsdp_wrap.apply_compile``); ``"model"``: :meth:`maybe_compile`, called after it,
    compiles the whole sharded model (``forge_fsdp_wrap.compile_after_sharding`` says when each
    pays off).

    ``packed_sequences`` (Hugging Face models only): None (default) = unknown, nothing changes.
    False = you promise no row packs several sequences: :meth:`parallelize` then hooks the model
    so that, while it runs, transformers' packed-sequence check (one host sync per attention
    layer per forward) is a constant False (:func:`forge.hf_patches.skip_packed_sequence_check`;
    nothing is changed outside the model's calls). True = packed: refused on a model hooked so.
    **With packed sequences never set it to False**: attention would cross document boundaries
    and the loss would be silently wrong.

    ``expert_tp``: each MoE expert's hidden units split over the ``tp`` axis (forge_moe_ep).
    """

    device_mesh: DeviceMesh | None
    _: KW_ONLY
    data: str | None = None
    ac_mode: str = "none"
    compile_model: bool = False
    compile_scope: str = "blocks"
    compile_backend: str = "inductor"
    mp_policy: MixedPrecisionPolicy | None = None
    param_dtype: torch.dtype = torch.bfloat16
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    tp_plan: Mapping[str, ParallelStyle | str | None] | str | None = None
    sequence_parallel: bool | None = None
    loss_parallel: bool = False
    allow_plan_import: bool | Sequence[str] = False
    float8: Float8Config = Float8Config()
    vlm: VLMConfig | None = None
    packed_sequences: bool | None = None
    pp: PPConfig = PPConfig()
    cp: CPConfig = CPConfig()
    expert_tp: bool = False

    @property
    def data_mode(self) -> str:
        """The data-parallel mode this plan applies: ``data`` as given, or for ``data=None``
        ``fsdp2`` when the mesh has a data-parallel axis and ``none`` otherwise (derived on
        each read: a frozen plan keeps the fields it was given)."""
        if self.data is not None:
            return self.data
        return "fsdp2" if has_dp_mesh(self.device_mesh) else "none"

    def __post_init__(self) -> None:
        sizes = {axis: axis_size(self.device_mesh, axis) for axis in ("cp", "pp", "tp", "domain")}
        check_plan(
            self.data_mode,
            sizes,
            ac_mode=self.ac_mode,
        )
        if self.data_mode in ("fsdp2", "ddp") and not has_dp_mesh(self.device_mesh):
            raise ForgeConfigError(
                f"data={self.data_mode!r} needs a mesh with a data-parallel axis; use data='none' on "
                "one device, or a mesh with dp_shard / dp_replicate > 1"
            )
        if self.compile_scope not in COMPILE_SCOPES:
            raise ForgeConfigError(
                f"compile_scope={self.compile_scope!r} is invalid: choose 'blocks' (each block "
                "compiled inside parallelize, before FSDP2) or 'model' (the whole sharded model, "
                "compiled by maybe_compile after parallelize)"
                + did_you_mean(str(self.compile_scope), COMPILE_SCOPES)
            )
        if self.packed_sequences not in (None, True, False):
            raise ForgeConfigError(
                f"packed_sequences={self.packed_sequences!r} must be None (unknown), True or False"
            )
        sections = {"float8": Float8Config, "vlm": VLMConfig, "pp": PPConfig, "cp": CPConfig}
        for name, kind in sections.items():
            value = getattr(self, name)
            if not isinstance(value, kind) and not (name == "vlm" and value is None):
                raise ForgeConfigError(
                    f"ParallelPlan({name}={value!r}): pass a {kind.__module__}.{kind.__name__}"
                )
        if sizes["pp"] > 1:  # the config's own checks (forge_cp, forge_pp), in its words
            refuse(cp_pipeline_problems(sizes["cp"], sizes["pp"]))
            refuse(stages_per_rank_problems(self.pp))

    @classmethod
    def from_config(
        cls,
        config: ForgeConfig | Mapping[str, Any] | str | Path,
        device_mesh: DeviceMesh | None,
        *,
        layout: Layout | None = None,
        **overrides: Any,
    ) -> ParallelPlan:
        """The plan ``forge build`` would use for ``config`` on ``device_mesh``.

        ``config``: a ``ForgeConfig``, a dict of sections or a TOML path. The plan takes the
        resolved ``layout`` (:func:`forge.layout.resolve_layout`, resolved here unless the
        caller has it for the mesh's ranks: ``data``, ``loss_parallel``, the fp8 all-gather),
        ``[training]`` ``ac_mode``, ``compile``, ``compile_scope``, ``param_dtype``,
        ``reshard_after_forward``, ``cpu_offload``; ``[tp]`` ``plan``, ``sequence_parallel``,
        ``allow_import``; ``[float8]`` and ``[vlm]``. Without a mesh ``data`` is ``"none"``.
        The mesh must have the layout ``[parallelism]`` resolves to (a ``ForgeConfigError``
        says which axes differ). ``overrides`` set fields the config has no key for
        (``compile_backend="aot_eager"``, ``mp_policy=...``, ``packed_sequences=False``) or
        replace mapped ones. The plan applies to any model, one you loaded yourself included
        (``from_config(cfg, mesh).parallelize(model)`` keeps its values).
        """
        cfg = as_config(config, "ParallelPlan.from_config")
        ranks = device_mesh.size() if device_mesh is not None else 1
        try:
            if layout is None or layout.world_size != ranks:
                layout = resolve_layout(cfg, ranks, device_type=_ranks_device_type(device_mesh))
        except ForgeConfigError as e:
            where = "device_mesh=None (one device)" if device_mesh is None else "the device_mesh"
            raise ForgeConfigError(
                f"the config's [parallelism] does not fit {where}: {e}"
            ) from None
        check_mesh_matches(layout.parallelism, device_mesh)
        check_float8(cfg.float8, layout.tp)
        names = {f.name for f in fields(cls) if f.init and f.name != "device_mesh"}
        for key in overrides:
            if key not in names:
                raise ForgeConfigError(
                    f"ParallelPlan.from_config got unknown field '{key}'{did_you_mean(key, names)}; "
                    f"fields: {sorted(names)}"
                )
        mapped = config_fields(cfg, layout, one_device=device_mesh is None)
        return cls(device_mesh, **{**mapped, **overrides})

    @property
    def ac_components(self) -> tuple[str, ...] | None:
        """The components AC covers: a VLM's ``vlm.ac_scope``; None (all) for other models.

        NOTE: resolved only when AC is on: ``ac_components`` refuses some scopes (vision with a
        frozen encoder) that do not matter without AC.
        """
        return ac_components(self.vlm, self.ac_mode)

    @property
    def fp8_all_gather(self) -> bool:
        """FSDP2's fp8 all-gather, as forge-float8 resolves it
        (:meth:`forge_float8.Float8Config.resolve_fsdp_all_gather`) for this plan's mesh."""
        backend = "gloo" if _ranks_device_type(self.device_mesh) == "cpu" else "nccl"
        return self.float8.resolve_fsdp_all_gather(
            data=self.data_mode, tp=axis_size(self.device_mesh, "tp"), dp_backend=backend
        )

    def parallelize(
        self,
        model: nn.Module,
        *,
        device: Device | None = None,
        seed: int | None = None,
        weights: Weights = None,
    ) -> nn.Module:
        """Apply the plan to ``model`` in order; with ``device``, materialize on it from ``seed``.

        A model on the meta device is materialized with ``to_empty(device)`` + ``init_weights(seed)``
        (after FSDP2, so each rank allocates only its shard; before DDP, which needs values).
        A model that already holds its values (loaded weights, a Hugging Face model) is sharded
        as it is: leave ``device`` out (move it to its device first) and give every rank the
        same values. Returns the model (the DDP wrapper for ``data='ddp'``); with
        ``compile_scope='model'`` pass what it returns to :meth:`maybe_compile`.

        ``weights``: a Hugging Face directory whose safetensors fill the Hugging Face model built
        on meta from its ``config.json``, each rank reading its slices (at pp > 1, its stages').

        A model made of components (a VLM) gets TP on its ``decoder`` (and on its ``encoder``
        with ``encoder_tp``), EP and Float8 on the decoder, AC on ``ac_components`` (None: all).
        """
        refuse(weights_call_problems(weights, device))
        if axis_size(self.device_mesh, "pp") <= 1:
            return self._parallelize_one(model, device=device, seed=seed, weights=weights)
        rank_model = self._parallelize_pipeline(model, device=device, seed=seed)
        if weights is not None:  # NOTE: over the seed's values; each rank reads its stages' only
            load_pipeline_weights(rank_model, weights)
        return rank_model

    def _parallelize_pipeline(
        self, model: nn.Module, *, device: torch.device | str | None, seed: int | None
    ) -> nn.Module:
        """:meth:`parallelize_stages` with a device, then the schedule over the stages. Returns
        the rank model (the unsplit names, this rank's blocks)."""
        mesh = self.device_mesh
        assert mesh is not None  # a pp axis of size > 1 implies a mesh
        if device is None:
            raise ForgeConfigError(
                "pipeline parallelism builds its stages on the meta device: call "
                "parallelize(model_on_meta, device=..., seed=...)"
            )
        split = self.parallelize_stages(model, device=device, seed=seed)
        share_buffers(split)
        return attach_schedule(split, mesh, self.pp, device)

    def parallelize_stages(
        self,
        model: nn.Module,
        *,
        device: torch.device | str | None = None,
        seed: int | None = None,
        pp_rank: int | None = None,
    ) -> PipelineSplit:
        """The PP split of a model on meta, then each stage module through the rest of the order
        (materialized when ``device`` is given), without the schedule.

        Stages get basic TP (no sequence parallelism: what passes between stages is a plain
        tensor) and FSDP2 keeping their parameters gathered between micro-batches. ``pp_rank``
        builds another pipeline rank's share (``forge plan`` plans every pipeline rank from one
        process); default: this rank's place on the mesh's ``pp`` axis.
        """
        mesh = self.device_mesh
        if axis_size(mesh, "pp") <= 1:
            raise ForgeConfigError("parallelize_stages needs a mesh with a pp axis of size > 1")
        assert mesh is not None
        if self.data_mode == "ddp" or self.compile_scope == "model" and self.compile_model:
            raise ForgeConfigError(
                "parallelism.pp > 1 supports data='fsdp2' or 'none' and per-block compile; "
                "set parallelism.data='fsdp2' and training.compile_scope='blocks'"
            )
        refuse(
            pipeline_stage_problems(
                sequence_parallel=self.sequence_parallel,
                loss_parallel=self.loss_parallel,
                pp=axis_size(mesh, "pp"),
            )
        )
        # NOTE: reshard_after_forward=False under PP: a stage runs the forwards of several
        # micro-batches before their backwards; resharding after each forward would all-gather
        # the stage's parameters again for every micro-batch (twice, forward and backward).
        # Keeping them gathered until the last backward costs one stage's unsharded parameters.
        keep = self.reshard_after_forward
        stage_plan = replace(
            self, sequence_parallel=False, reshard_after_forward=False if keep is True else keep
        )
        split = pipeline_split(model, mesh, self.pp, pp_rank=pp_rank)
        for stage in split.stages:
            stage_plan._parallelize_one(stage, device=device, seed=seed)
        return split

    def _parallelize_one(
        self, model: nn.Module, *, device: Device | None, seed: int | None, weights: Weights = None
    ) -> nn.Module:
        """The stages in forge's order on one model (or one pipeline stage's module)."""
        if device is not None:
            refuse_materialized(model, device)
        mesh = self.device_mesh
        spec = model_spec(model, mesh, vlm=self.vlm, packed_sequences=self.packed_sequences)
        refuse(hf_compile_problems(spec.kind == "hf", axis_size(mesh, "tp"), self.compile_model))
        if axis_size(mesh, "tp") > 1:
            assert mesh is not None  # a tp axis of size > 1 implies a mesh
            spec.tensor_parallel(
                mesh,
                plan=self.tp_plan,
                sequence_parallel=self.sequence_parallel,
                loss_parallel=self.loss_parallel,
                allow_import=self.allow_plan_import,
                vlm=self.vlm,
            )
        if axis_size(mesh, "cp") > 1:
            assert mesh is not None  # a cp axis of size > 1 implies a mesh
            apply_context_parallel(model, mesh, variant=self.cp.variant)
        spec.expert_parallel(mesh, expert_tp=self.expert_tp)
        if self.float8.enabled:  # a VLM's decoder; its encoder and adapter stay in high precision
            apply_float8(
                spec.decoder,
                recipe=self.float8.recipe,
                enable_fsdp_float8_all_gather=self.fp8_all_gather,
                filter_fqns=self.float8.filter_fqns,
                device=device,
            )
        if axis_size(mesh, "domain") > 1:
            assert mesh is not None  # a domain axis of size > 1 implies a mesh
            apply_domain_parallel(model, mesh)
        if self.ac_mode != "none":
            no_kv_cache_under_ac(model, self.ac_mode)
            apply_ac(model, self.ac_mode, components=self.ac_components)
        if self.compile_model and self.compile_scope == "blocks":
            apply_compile(model, backend=self.compile_backend)
        if self.data_mode == "fsdp2":
            mp = self.mp_policy or default_mp_policy(self.param_dtype)
            assert mesh is not None  # data='fsdp2' has a DP axis (__post_init__)
            apply_fsdp2(
                model,
                mesh,
                mp,
                self.reshard_after_forward,
                self.cpu_offload,
                shard_frozen=shard_frozen(self.vlm),
            )
        if device is not None:
            # NOTE: with CPU offload the sharded parameters live on the CPU (FSDP2 copies them
            # to the device per unit); buffers are not managed by FSDP2 and must be on the device.
            offload = self.cpu_offload and self.data_mode == "fsdp2"
            param_device = "cpu" if offload else device
            spec.materialize(device, seed or 0, param_device=param_device, weights=weights)
        if self.data_mode in ("ddp", "none") and self.param_dtype != torch.float32:
            enable_autocast(model, self.param_dtype)
        if self.data_mode == "ddp":
            assert mesh is not None  # data='ddp' has a DP axis (__post_init__)
            return apply_ddp(model, mesh)
        return model

    def maybe_compile(self, model: nn.Module) -> nn.Module:
        """Whole-model ``torch.compile`` after sharding, when the plan asks for it; returns the model.

        Call it on what :meth:`parallelize` returned, once, before training. With
        ``compile_model=False`` it does nothing; otherwise
        :func:`forge_fsdp_wrap.compile_after_sharding` with ``compile_scope``: nothing more for
        ``'blocks'`` (compiled inside :meth:`parallelize`; refused if it has not run), the whole
        model compiled in place for ``'model'`` (never twice; refused over compiled blocks).
        """
        if not self.compile_model:
            return model
        return compile_after_sharding(model, scope=self.compile_scope, backend=self.compile_backend)


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
    compile_scope: str = "blocks",
    fp8: bool = False,
    fp8_recipe: str = "tensorwise",
    fp8_fsdp_all_gather: bool | None = None,
    fp8_filter_fqns: Sequence[str] = (),
    data: str | None = None,
    seed: int = 0,
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    tp_plan: Mapping[str, ParallelStyle | str | None] | str | None = None,
    sequence_parallel: bool | None = None,
    loss_parallel: bool = False,
    allow_plan_import: bool | Sequence[str] = False,
) -> nn.Module:
    """Build the reference Transformer (or a VLM) on the meta device, parallelize, materialize.

    The pipeline, top to bottom: model on meta -> TP -> CP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2
    -> materialize (``to_empty`` + ``init_weights(seed)``: identical values to a single-device
    model built with the same seed). ``device_mesh=None`` builds a plain single-device model.

    With ``vlm_config`` (and ``vision_config``, ``adapter_config``) the model is a
    ``forge_vlm.VLMWrapper`` whose decoder is ``model_config``; ``vlm_config`` says whether the
    encoder is frozen, TP-split (its own plan) and which components AC covers (``ac_scope``).

    The keywords are :class:`ParallelPlan`'s fields (``fp8*`` are its ``float8`` section's,
    ``vlm_config`` is its ``vlm``); with ``compile_scope='model'`` the
    returned model is already compiled as a whole (:meth:`ParallelPlan.maybe_compile`).
    """
    model = build_meta_model(model_config, vision_config, adapter_config, vlm_config)
    # NOTE: the contract's flat fp8 keywords become forge-float8's own section here, the one
    # place they are translated; ParallelPlan reads Float8Config as it is.
    float8 = Float8Config(
        enabled=fp8,
        recipe=fp8_recipe,
        fsdp_float8_all_gather="auto" if fp8_fsdp_all_gather is None else fp8_fsdp_all_gather,
        filter_fqns=tuple(fp8_filter_fqns),
    )
    plan = ParallelPlan(
        device_mesh,
        data=data,
        ac_mode=ac_mode,
        compile_model=compile_model,
        compile_backend=compile_backend,
        compile_scope=compile_scope,
        mp_policy=mp_policy,
        param_dtype=param_dtype,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
        tp_plan=tp_plan,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        allow_plan_import=allow_plan_import,
        float8=float8,
        vlm=vlm_config,
    )
    return plan.maybe_compile(plan.parallelize(model, device=device, seed=seed))
