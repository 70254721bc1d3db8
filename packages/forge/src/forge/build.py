"""Composition: apply forge's layers to a model in the one correct order.

    mesh -> model on meta -> TP -> CP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2 -> materialize
                                                            (DDP: materialize -> DDP)

EP runs whenever the model has MoE layers and a mesh: with an ``ep`` axis it shards the experts
and installs the token dispatch hooks; either way each MoE layer gets a load hook that sums its
token counts over the data-parallel ranks (load balancing). The layers hold no process group.

A vision-language model (``forge_vlm.VLMWrapper``: components encoder, adapter, decoder) goes
through the same order, per component: TP on the decoder (its plan, SP) and optionally on the
encoder (its own plan, no SP) -> EP and Float8 on the decoder -> AC on the components
``ac_scope`` names ->
compile every component's blocks -> FSDP2 units encoder blocks, encoder, adapter, decoder
blocks, decoder, root (a frozen encoder may stay replicated instead; see
``forge_fsdp_wrap.apply_fsdp2``). The stage-order contract checks each component.

From a config (what ``forge build`` does, for a model you already have)::

    plan = ParallelPlan.from_config("job.toml", mesh)   # or a ForgeConfig, or a dict
    model = plan.maybe_compile(plan.parallelize(model))

:meth:`ParallelPlan.from_config` is the one mapping from a ``ForgeConfig`` to a plan;
``forge build`` (``forge.job``) uses it too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core import ForgeConfigError, ModelConfig, applied_stages
from forge_core.config import ParallelismConfig
from forge_core.contracts import declared_components, model_components
from forge_core.errors import did_you_mean, refuse
from forge_core.mesh_dims import axis_size, get_dp_mesh, has_dp_mesh
from forge_core.torch_compat import is_compiled, non_persistent_buffer_names
from forge_cp import apply_context_parallel
from forge_cp.checks import cp_pipeline_problems
from forge_domain import apply_domain_parallel
from forge_float8 import Float8Config, apply_float8
from forge_fsdp_wrap import (
    apply_ac,
    apply_compile,
    apply_ddp,
    apply_fsdp2,
    default_mp_policy,
    enable_autocast,
)
from forge_moe_ep import MoE, apply_expert_parallel
from forge_pp import PipelineSplit, attach_schedule, pipeline_split, share_buffers
from forge_pp.checks import stages_per_rank_problems
from forge_pp.config import PPConfig
from forge_tp_plans import apply_tensor_parallel
from forge_tp_plans.checks import pipeline_stage_problems
from forge_vlm import (
    AdapterConfig,
    VisionEncoderConfig,
    VLMConfig,
    check_encoder_tp,
)
from forge_vlm import ac_components as vlm_ac_components
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from .checks import check_float8, check_plan
from .config import COMPILE_SCOPES, ForgeConfig, load_config
from .hf_prepare import apply_packed_sequences, no_kv_cache_under_ac, prepare_hf
from .layout import Layout, resolve_layout
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


def _as_config(config: ForgeConfig | Mapping[str, Any] | str | Path) -> ForgeConfig:
    if isinstance(config, ForgeConfig):
        return config
    if isinstance(config, Mapping | str | Path):
        return load_config(config)
    raise ForgeConfigError(
        f"ParallelPlan.from_config(config=...) got a {type(config).__name__}: pass a ForgeConfig, "
        "a dict of config sections or the path of a TOML file"
    )


#: Mesh axes a ``[parallelism]`` section sizes (``ep`` is a view carved from ``dp_shard``).
_LAYOUT_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "domain", "tp", "ep")


def _check_mesh_matches(par: ParallelismConfig, mesh: DeviceMesh | None) -> None:
    """Refuse a mesh whose axis sizes differ from the config's resolved ``[parallelism]``.

    NOTE: a plan reads the layout from the mesh; a config that says tp=2 next to a mesh without
    a tp axis would otherwise be followed silently without TP (and its TP options ignored).
    """
    wrong = {
        axis: (getattr(par, axis), axis_size(mesh, axis))
        for axis in _LAYOUT_AXES
        if getattr(par, axis) != axis_size(mesh, axis)
    }
    if wrong:
        ranks = mesh.size() if mesh is not None else 1
        said = ", ".join(f"{a}={want}" for a, (want, _) in wrong.items())
        has = ", ".join(f"{a}={got}" for a, (_, got) in wrong.items())
        fix = ", ".join(f"parallelism.{a}={got}" for a, (_, got) in wrong.items())
        mesh_text = "device_mesh=None (one device)" if mesh is None else "the device_mesh"
        raise ForgeConfigError(
            f"the config's [parallelism] resolves to {said} on {ranks} rank(s), but {mesh_text} "
            f"has {has}: build the mesh from the same config "
            "(forge_mesh.build_device_mesh(cfg.resolved_parallelism(world_size), ...)) or set "
            f"{fix} in the config"
        )


@dataclass(frozen=True)
class ParallelPlan:
    """How to parallelize a model over ``device_mesh``; :meth:`parallelize` applies it.

    Build one directly (``ParallelPlan(mesh, data="fsdp2", ...)``: every field after the mesh is
    a keyword) or from a config with :meth:`from_config` (exactly what ``forge build`` runs).
    Then::

        model = plan.maybe_compile(plan.parallelize(model))

    A plan is frozen: :func:`dataclasses.replace` makes a changed copy (checked again).

    ``data``: ``fsdp2`` | ``ddp`` | ``none``; None picks ``fsdp2`` when the mesh has a DP axis.
    ``param_dtype`` is the compute dtype; parameters (master weights) stay float32 in every mode.
    FSDP2 gets it through ``default_mp_policy`` (ignored when ``mp_policy`` is given); DDP and
    ``none`` run the forward under ``torch.autocast(param_dtype)`` (see ``enable_autocast``).

    ``float8`` is forge-float8's own ``[float8]`` section (``Float8Config``): Float8 on the
    decoder when ``enabled``. ``vlm`` is forge-vlm's ``[vlm]`` section (``VLMConfig``) for a
    model made of components: TP on the encoder (``encoder_tp``, ``encoder_tp_plan``), which
    components AC covers (``ac_scope``), whether a frozen encoder is sharded
    (``shard_frozen_encoder``). Both are read as they are: no renamed copies of their fields.

    ``compile_model`` turns ``torch.compile`` on; ``compile_scope`` says where:

    - ``"blocks"`` (default): :meth:`parallelize` compiles each block (``apply_compile``) after
      AC and before FSDP2: one graph shared by all blocks, no graph breaks at FSDP2's hooks,
      parameter names unchanged. :meth:`maybe_compile` then has nothing left to do.
    - ``"model"``: :meth:`parallelize` compiles nothing; :meth:`maybe_compile`, called after it,
      compiles the whole sharded model in place (``nn.Module.compile``: names unchanged),
      with graph breaks where FSDP2's hooks run. For models whose blocks cannot be compiled on
      their own, or to let the compiler see across blocks.

    ``packed_sequences`` (Hugging Face models only): None (default) = unknown, nothing changes.
    False = you promise no row packs several sequences: :meth:`parallelize` then hooks the model
    so that, while it runs, transformers' packed-sequence check (one host sync per attention
    layer per forward) is a constant False (:func:`forge.hf_patches.skip_packed_sequence_check`;
    nothing is changed outside the model's calls). True = packed: refused on a model hooked so.
    **With packed sequences never set it to False**: attention would cross document boundaries
    and the loss would be silently wrong.
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

    def __post_init__(self) -> None:
        sizes = {axis: axis_size(self.device_mesh, axis) for axis in ("cp", "pp", "tp", "domain")}
        if self.data is None:  # frozen: the resolved default is set once, here
            object.__setattr__(self, "data", "fsdp2" if has_dp_mesh(self.device_mesh) else "none")
        check_plan(
            str(self.data),
            sizes,
            ac_mode=self.ac_mode,
        )
        if self.data in ("fsdp2", "ddp") and not has_dp_mesh(self.device_mesh):
            raise ForgeConfigError(
                f"data={self.data!r} needs a mesh with a data-parallel axis; use data='none' on "
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
        for name, kind in (("float8", Float8Config), ("vlm", VLMConfig), ("pp", PPConfig)):
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

        ``config``: a loaded ``ForgeConfig``, a dict of sections or a TOML path (both read with
        ``forge.config.load_config``). What the plan takes from it: the resolved layout
        (:func:`forge.layout.resolve_layout`: ``data``, ``loss_parallel``), ``[training]``
        ``ac_mode``, ``compile``, ``compile_scope``, ``param_dtype``, ``reshard_after_forward``,
        ``cpu_offload``; ``[tp]`` ``plan``, ``sequence_parallel``, ``allow_import``; the
        ``[float8]`` and ``[vlm]`` sections as they are. Without a mesh ``data`` is ``"none"``.

        The mesh must have the layout ``[parallelism]`` resolves to for its number of ranks (a
        ``ForgeConfigError`` says which axes differ): build it from the same config. Sections
        about the training job itself (steps, batch, model shape) are not read here.

        ``layout``: the config's resolved :class:`forge.layout.Layout` on the mesh's ranks, when
        the caller has it (a rank resolves it once); resolved here otherwise.

        ``overrides`` set fields the config has no key for (``compile_backend="aot_eager"``,
        ``mp_policy=...``, ``packed_sequences=False``) or replace mapped ones.

        The plan applies to any model: ``from_config(cfg, mesh).parallelize(model)`` on a model
        you built and loaded yourself (a Hugging Face model, your own) keeps its values.
        """
        cfg = _as_config(config)
        ranks = device_mesh.size() if device_mesh is not None else 1
        try:
            if layout is None or layout.world_size != ranks:
                layout = resolve_layout(cfg, ranks)
        except ForgeConfigError as e:
            where = "device_mesh=None (one device)" if device_mesh is None else "the device_mesh"
            raise ForgeConfigError(
                f"the config's [parallelism] does not fit {where}: {e}"
            ) from None
        _check_mesh_matches(layout.parallelism, device_mesh)
        check_float8(cfg.float8, layout.tp)
        names = {f.name for f in fields(cls) if f.init and f.name != "device_mesh"}
        for key in overrides:
            if key not in names:
                raise ForgeConfigError(
                    f"ParallelPlan.from_config got unknown field '{key}'{did_you_mean(key, names)}; "
                    f"fields: {sorted(names)}"
                )
        t = cfg.training
        mapped: dict[str, Any] = {
            "data": layout.data if device_mesh is not None else "none",  # no mesh: one device
            "ac_mode": t.ac_mode,
            "compile_model": t.compile,
            "compile_scope": t.compile_scope,
            "param_dtype": getattr(torch, t.param_dtype),
            "reshard_after_forward": t.reshard_after_forward,
            "cpu_offload": t.cpu_offload,
            "tp_plan": cfg.tp.plan,
            "sequence_parallel": cfg.tp.sequence_parallel_flag,  # None: per model, by forge_tp_plans
            "loss_parallel": layout.loss_parallel,
            "allow_plan_import": cfg.tp.allow_import,
            "float8": cfg.float8,
            "vlm": cfg.vlm,
            "pp": cfg.pp,
        }
        return cls(device_mesh, **{**mapped, **overrides})

    @property
    def ac_components(self) -> tuple[str, ...] | None:
        """The components AC covers: a VLM's ``vlm.ac_scope``; None (all) for other models.

        NOTE: resolved only when AC is on: ``ac_components`` refuses some scopes (vision with a
        frozen encoder) that do not matter without AC.
        """
        if self.vlm is None or self.ac_mode == "none":
            return None
        return vlm_ac_components(self.vlm.ac_scope, self.vlm.freeze_encoder)

    @property
    def fp8_all_gather(self) -> bool:
        """FSDP2's fp8 all-gather, as forge-float8 resolves it
        (:meth:`forge_float8.Float8Config.resolve_fsdp_all_gather`) for this plan's mesh."""
        backend = None
        if self.data == "fsdp2" and self.device_mesh is not None:
            backend = str(dist.get_backend(get_dp_mesh(self.device_mesh).get_group(0)))
        return self.float8.resolve_fsdp_all_gather(
            data=str(self.data), tp=axis_size(self.device_mesh, "tp"), dp_backend=backend
        )

    def parallelize(
        self, model: nn.Module, *, device: torch.device | str | None = None, seed: int | None = None
    ) -> nn.Module:
        """Apply the plan to ``model`` in order; with ``device``, materialize on it from ``seed``.

        A model on the meta device is materialized with ``to_empty(device)`` + ``init_weights(seed)``
        (after FSDP2, so each rank allocates only its shard; before DDP, which needs values).
        A model that already holds its values (loaded weights, a Hugging Face model) is sharded
        as it is: leave ``device`` out (move it to its device first) and give every rank the
        same values. Returns the model (the DDP wrapper for ``data='ddp'``); with
        ``compile_scope='model'`` pass what it returns to :meth:`maybe_compile`.

        A model made of components (a VLM) gets TP on its ``decoder`` (and on its ``encoder``
        with ``encoder_tp``), EP and Float8 on the decoder, AC on ``ac_components`` (None: all).
        """
        if axis_size(self.device_mesh, "pp") > 1:
            return self._parallelize_pipeline(model, device=device, seed=seed)
        return self._parallelize_one(model, device=device, seed=seed)

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
        if self.data == "ddp" or self.compile_scope == "model" and self.compile_model:
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
        self, model: nn.Module, *, device: torch.device | str | None, seed: int | None
    ) -> nn.Module:
        """The stages in forge's order on one model (or one pipeline stage's module)."""
        if device is not None:
            _refuse_materialized(model, device)
        apply_packed_sequences(model, self.packed_sequences)
        mesh = self.device_mesh
        hf = prepare_hf(model, mesh)
        parts = dict(model_components(model))
        decoder = parts.get("decoder", model)
        if self._encoder_tp:
            self._encoder_tp_problem(model, parts.get("encoder"))
        if axis_size(mesh, "tp") > 1:
            self._tensor_parallel(model, hf, decoder, parts.get("encoder"))
        if axis_size(mesh, "cp") > 1:
            assert mesh is not None  # a cp axis of size > 1 implies a mesh
            apply_context_parallel(model, mesh)
        _expert_parallel(decoder, mesh)
        if self.float8.enabled:  # a VLM's decoder; its encoder and adapter stay in high precision
            apply_float8(
                decoder,
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
        if self.data == "fsdp2":
            mp = self.mp_policy or default_mp_policy(self.param_dtype)
            assert mesh is not None  # data='fsdp2' has a DP axis (__post_init__)
            apply_fsdp2(
                model,
                mesh,
                mp,
                self.reshard_after_forward,
                self.cpu_offload,
                shard_frozen=None if self.vlm is None else self.vlm.shard_frozen_flag,
            )
        if device is not None:
            self._materialize(model, parts.values(), device, seed or 0)
        if self.data in ("ddp", "none") and self.param_dtype != torch.float32:
            enable_autocast(model, self.param_dtype)
        if self.data == "ddp":
            assert mesh is not None  # data='ddp' has a DP axis (__post_init__)
            return apply_ddp(model, mesh)
        return model

    @property
    def _encoder_tp(self) -> bool:
        return self.vlm is not None and self.vlm.encoder_tp

    def _encoder_tp_problem(self, model: nn.Module, encoder: nn.Module | None) -> None:
        """Refuse ``vlm.encoder_tp`` on a model that has no encoder component."""
        if encoder is None and "encoder" not in declared_components(model):
            raise ForgeConfigError(
                f"encoder_tp=True but {type(model).__name__} has no encoder component"
            )

    def _tensor_parallel(
        self, model: nn.Module, hf: bool, decoder: nn.Module, encoder: nn.Module | None
    ) -> None:
        """TP on the decoder (a Hugging Face model: on the whole model) and, when asked, on the
        VLM's encoder with its own plan."""
        mesh = self.device_mesh
        assert mesh is not None  # a tp axis of size > 1 implies a mesh
        apply_tensor_parallel(
            # NOTE: a Hugging Face VLM's plan is written for the whole model (it names
            # model.language_model.* and lm_head, which lies outside the language model).
            model if hf else decoder,
            mesh,
            plan=self.tp_plan,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            allow_import=self.allow_plan_import,
        )
        if self._encoder_tp and encoder is not None:
            assert self.vlm is not None
            encoder_config = getattr(encoder, "config", None)
            if isinstance(encoder_config, VisionEncoderConfig):
                check_encoder_tp(encoder_config, axis_size(mesh, "tp"))
            apply_tensor_parallel(
                encoder,
                mesh,
                plan=self.vlm.encoder_tp_plan,
                sequence_parallel=False,
                allow_import=self.allow_plan_import,
            )

    def _materialize(
        self, model: nn.Module, parts: Iterable[nn.Module], device: torch.device | str, seed: int
    ) -> None:
        # NOTE: with CPU offload the sharded parameters live on the CPU (FSDP2 copies them to
        # the device per unit); buffers are not managed by FSDP2 and must be on the device.
        param_device = "cpu" if self.cpu_offload and self.data == "fsdp2" else device
        materialize(model, device, seed, param_device=param_device)
        for part in parts:  # a component left out of FSDP2 computes on the device
            if param_device != device and not isinstance(part, FSDPModule):
                part.to(device)

    def maybe_compile(self, model: nn.Module) -> nn.Module:
        """Whole-model ``torch.compile`` after sharding, when the plan asks for it; returns the model.

        Call it on what :meth:`parallelize` returned, once, before training. What it does:

        - ``compile_model=False``: nothing (returns ``model`` as it is).
        - ``compile_scope='blocks'``: nothing more: :meth:`parallelize` already compiled each
          block before FSDP2. Refused if the model has no compile stage (not parallelized with
          this plan yet: call :meth:`parallelize` first).
        - ``compile_scope='model'``: compiles ``model`` in place (``nn.Module.compile``:
          parameter and state-dict names keep no ``_orig_mod.`` prefix), with
          ``compile_backend`` and static shapes; FSDP2's hooks run eagerly between graphs.
          A model already compiled (by an earlier call, ``torch.compile`` or ``nn.Module.compile``)
          is returned unchanged: never compiled twice. A model whose blocks are compiled
          (``apply_compile``) is refused: the whole-model compile would compile them again.

        NOTE: static shapes (``dynamic=False``) as for the blocks: DTensor (TP) fails under
        symbolic shapes in inductor, so each new input shape compiles its own graph.

        NOTE: under FSDP2 the graphs stop at every FSDP2 unit: dynamo runs FSDP2's hooks
        eagerly (``torch._dynamo.config.skip_fsdp_hooks``), and a graph break inside a loop
        makes it run that whole frame eagerly. On forge's Transformer (torch 2.15) the root's
        forward, whose loop over the blocks crosses each block's hooks, runs eagerly and each
        block's forward becomes the compiled graph, so ``"blocks"`` is the better scope for an
        FSDP2 model; ``"model"`` pays off where no hooks cut the model (``data='none'``, DDP,
        or units that are not called in a loop).
        """
        if not self.compile_model:
            return model
        compiled_blocks = "compile" in applied_stages(model)
        if self.compile_scope == "blocks":
            if not compiled_blocks:
                raise ForgeConfigError(
                    "maybe_compile with compile_scope='blocks': the blocks are compiled inside "
                    "parallelize(), which has not run on this model; call "
                    "plan.maybe_compile(plan.parallelize(model))"
                )
            return model
        if is_compiled(model):
            return model  # already compiled as a whole
        if compiled_blocks:
            raise ForgeConfigError(
                "maybe_compile with compile_scope='model' on a model whose blocks are already "
                "compiled (apply_compile, or a plan with compile_scope='blocks'): it would compile "
                "them twice; use compile_scope='blocks', or rebuild the model without block compile"
            )
        model.compile(backend=self.compile_backend, dynamic=False)
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
    init_weights = getattr(model, "init_weights", None)
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


def _refuse_materialized(model: nn.Module, device: torch.device | str) -> None:
    """``parallelize(device=...)`` initialises a meta model from the seed; refuse a model that
    already holds values (they would be silently re-initialised)."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ForgeConfigError(
            f"parallelize(device={str(device)!r}) materializes a model on the meta device from "
            f"a seed, but this {type(model).__name__} already holds its values (they would be "
            "re-initialized); call parallelize(model) without device, after moving the model "
            "to its device"
        )


def _expert_parallel(decoder: nn.Module, mesh: DeviceMesh | None) -> None:
    """EP on the decoder's MoE layers; an ep axis without one is refused."""
    has_moe = any(isinstance(m, MoE) for m in decoder.modules())
    if mesh is not None and (has_moe or axis_size(mesh, "ep") > 1):
        apply_expert_parallel(decoder, mesh)  # an ep axis without an MoE: the layer refuses it
