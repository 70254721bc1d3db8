"""A vision-language model's kind (``forge_vlm.VLMWrapper``: ``[vision]``, ``[adapter]``,
``[vlm]``): forge's decoder behind a vision encoder and an adapter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from forge_vlm.checks import ac_scope_problems, vlm_problems

from ..paths import importable_problems
from .decoder import DecoderKind
from .field import NO_HF_LAYOUT

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from forge_core import ParallelismConfig
    from torch.distributed.device_mesh import DeviceMesh

    from ..data import Batch, FieldBatch, StepData
    from ..layout import Layout

__all__ = ["VLMKind"]

VLM_TOKEN_FILE = (
    "data.path with a vision-language model: a token file holds no images; leave data.path "
    "unset (synthetic image-text data)"
)


@dataclass(frozen=True)
class VLMKind(DecoderKind):
    """A vision-language model: forge's decoder behind a vision encoder and an adapter."""

    label: ClassVar[str] = "VLM decoder"
    name: ClassVar[str] = "vlm"
    first_stage: ClassVar[str] = "encoder + adapter + embedding"

    def problems(self, layout: Layout) -> list[str]:
        cfg, t, par = self.cfg, self.cfg.training, layout.parallelism
        v, a, vlm = cfg.vlm_sections()
        problems = super().problems(layout)
        problems += vlm_problems(cfg.decoder, v, a, vlm, seq_len=t.seq_len, tp=par.tp)
        problems += ac_scope_problems(vlm.ac_scope, vlm.freeze_encoder)
        if vlm.encoder_tp_plan is not None:
            plan, allow = vlm.encoder_tp_plan, cfg.tp.allow_import
            problems += importable_problems("vlm.encoder_tp_plan", plan, allow)
        return problems

    def import_problems(self, layout: Layout) -> list[str]:
        """Import ``vlm.encoder_tp_plan`` (calling nothing) under tp, so that a missing module or
        name is one line before launch, as for ``tp.plan``."""
        from forge_core.errors import ForgeConfigError
        from forge_tp_plans import load_plan_object

        vlm = self.cfg.vlm_sections()[2]
        if layout.parallelism.tp <= 1 or vlm.encoder_tp_plan is None:
            return []
        try:
            load_plan_object(vlm.encoder_tp_plan, self.cfg.tp.allow_import)
        except ForgeConfigError as err:
            return [f"vlm.encoder_tp_plan: {err}"]
        return []

    def hf_export_problems(self) -> list[str]:
        return [NO_HF_LAYOUT]

    def data(
        self, dp_rank: int, dp_size: int, *, image_token_id: int | None, image_tokens: int
    ) -> StepData[Batch] | StepData[FieldBatch]:
        """Synthetic image-text data (a token file holds no images)."""
        from forge_core.errors import ForgeConfigError

        from ..data import SyntheticVLMData

        if self.cfg.data.path is not None:
            raise ForgeConfigError(VLM_TOKEN_FILE)
        # NOTE: the VLM wrapper (built from this config) always gives its placeholder id
        assert image_token_id is not None
        return SyntheticVLMData(
            self.cfg, dp_rank, dp_size, image_token_id=image_token_id, image_tokens=image_tokens
        )

    def validation_data(self, dp_rank: int, dp_size: int) -> StepData[Batch] | None:
        return None  # NOTE: no text: data_problems refuses any data.path

    def data_problems(self) -> list[str]:
        """A token file or text holds no images: any ``data.path`` is refused."""
        return [] if self.cfg.data.path is None else [VLM_TOKEN_FILE]

    def describe(self) -> tuple[str, str]:
        model, data = super().describe()
        return model + " + vision encoder", data

    def build_steps(self, reference: nn.Module) -> tuple[torch.Tensor, dict[str, Any]]:
        """Synthetic image-text batches, their images and the placeholder id the loss skips."""
        from ..build_report import vlm_wrapper
        from ..data import SyntheticVLMData

        wrapper = vlm_wrapper(reference)
        ids = {"image_token_id": wrapper.image_token_id, "image_tokens": wrapper.image_tokens}
        data = SyntheticVLMData(self.cfg, 0, 1, **ids)
        tokens, images = data.steps(0, self.cfg.training.steps)
        return tokens, {"images": images, "ignore_token": wrapper.image_token_id}

    def decoder_reports(
        self,
        model: nn.Module,
        batch: torch.Tensor,
        par: ParallelismConfig,
        device: torch.device,
        mesh: DeviceMesh,
    ) -> tuple[str | None, list[str] | None]:
        return None, None  # NOTE: a token batch alone is no VLM step

    def checkpointed_components(self) -> tuple[str, ...]:
        """The components ``vlm.ac_scope`` checkpoints."""
        from forge_vlm import ac_components

        vlm = self.cfg.vlm_sections()[2]
        return ac_components(vlm.ac_scope, vlm.freeze_encoder)

    def input_activation_bytes(
        self, *, b: int, s: int, dim: int, tp: int, itemsize: int
    ) -> dict[str, int]:
        """The vision encoder's, the adapter's and the image embeddings' (forge_vlm.costs)."""
        from dataclasses import asdict

        from forge_vlm.costs import vlm_activation_bytes

        v, a, vlm = self.cfg.vlm_sections()
        vis = vlm_activation_bytes(v, a, vlm, b=b, s=s, dim=dim, tp=tp, itemsize=itemsize)
        out = asdict(vis)
        out["full_recompute"] = out.pop("recompute")
        return out

    def part_lines(self, model: nn.Module, par: ParallelismConfig) -> list[str]:
        """Encoder, adapter and image tokens, what is frozen, and TP per component."""
        from forge_core import applied_stages
        from forge_tp_plans import describe_tp_plan
        from forge_vlm import ac_components, num_image_tokens
        from torch.distributed.fsdp import FSDPModule

        from ..build_report import tp_description, vlm_wrapper

        v, a, vlm = self.cfg.vlm_sections()
        wrapper = vlm_wrapper(model)
        encoder = wrapper.encoder
        if not vlm.freeze_encoder:
            state = "trainable, FSDP2 per block"
        elif any(isinstance(m, FSDPModule) for m in encoder.modules()):
            state = "frozen, FSDP2-sharded (no gradients, no optimizer state)"
        else:
            state = "frozen, replicated outside FSDP2 (no gradients, no optimizer state)"
        ac_mode = self.cfg.training.ac_mode
        ac = (
            "no AC"
            if ac_mode == "none"
            else f"AC {ac_mode} (scope {vlm.ac_scope}) on "
            + " and ".join(ac_components(vlm.ac_scope, vlm.freeze_encoder))
        )
        lines = [
            f"vlm:    {vlm.design} decoder; {v.backend} encoder {v.n_layers} layers x dim {v.dim} "
            f"on {v.image_size}px images ({v.grid}x{v.grid} patches of {v.patch_size}px) -> "
            f"adapter (pool {a.pool}) -> {num_image_tokens(v, a)} image tokens at placeholder id "
            f"{wrapper.image_token_id}; encoder {state}; {ac}",
            "        per component: "
            + "; ".join(
                f"{name} {' -> '.join(applied_stages(part)) or '(none)'}"
                for name, part in (("encoder", encoder), ("decoder", wrapper.decoder))
            ),
        ]
        if par.tp > 1:
            lines.append("tp:     decoder " + tp_description(wrapper.decoder, par))
            if vlm.encoder_tp:
                lines.append("tp:     encoder " + describe_tp_plan(encoder))
        return lines

    def tp_lines(self, model: nn.Module, par: ParallelismConfig) -> list[str]:
        return []  # NOTE: part_lines says TP per component
