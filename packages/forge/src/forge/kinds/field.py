"""A field model's kind (``forge_domain.FieldNet``, a conv net over 2-D fields: ``[field]``),
split by height over ``parallelism.domain``; it has no tokens and no sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .decoder import DecoderKind

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from ..data import Batch, FieldBatch, StepData
    from ..layout import Layout

__all__ = ["NO_HF_LAYOUT", "FieldKind"]

NO_HF_LAYOUT = (
    "only the reference decoder has a Hugging Face Llama layout; export this model with "
    "layout='safetensors'"
)


@dataclass(frozen=True)
class FieldKind(DecoderKind):
    """A field model (``forge_domain.FieldNet``): a conv net over 2-D fields, split by height
    over ``parallelism.domain``; it has no tokens and no sequence."""

    label: ClassVar[str] = "field model"
    name: ClassVar[str] = "field"

    def problems(self, layout: Layout) -> list[str]:
        """What a field model cannot be combined with."""
        cfg, par = self.cfg, layout.parallelism
        field = cfg.field_section()
        unsupported = {
            "parallelism.tp": par.tp > 1,
            "parallelism.ep": par.ep > 1,
            "parallelism.pp": par.pp > 1,
            "float8.enabled": layout.float8,
            "data.path": cfg.data.path is not None,
        }
        problems = [
            f"{key} is set for a field model ([field]): FieldNet is a conv net; it takes data "
            "parallelism and parallelism.domain (height split), not this; unset it"
            for key, bad in unsupported.items()
            if bad
        ]
        if field.height < par.domain:
            problems.append(
                f"field.height={field.height} gives fewer rows than parallelism.domain="
                f"{par.domain} ranks; lower domain or raise the height"
            )
        return problems

    def pipeline_problems(self, layout: Layout) -> list[str]:
        return []  # NOTE: problems() has said that a field model takes no pipeline

    def build_problems(self) -> list[str]:
        return [
            "forge build checks token models against one device; a field model "
            "(model.preset=debug_field) trains with forge train (its parity is in the tests)"
        ]

    def plan_problems(self) -> list[str]:
        return [
            "forge plan models token models (the reference decoder, MoE, VLM); a field model "
            "([field], model.preset=debug_field) is not planned yet: its activations are 2-D fields"
        ]

    def hf_export_problems(self) -> list[str]:
        return [NO_HF_LAYOUT]

    def data(
        self, dp_rank: int, dp_size: int, *, image_token_id: int | None, image_tokens: int
    ) -> StepData[Batch] | StepData[FieldBatch]:
        """Synthetic fields (a token file holds no fields)."""
        from forge_core.errors import ForgeConfigError

        from ..data import SyntheticFields

        if self.cfg.data.path is not None:
            raise ForgeConfigError(
                "data.path with a field model: a token file holds no fields; leave data.path "
                "unset (synthetic fields)"
            )
        return SyntheticFields(self.cfg, dp_rank, dp_size)

    def data_problems(self) -> list[str]:
        return []  # NOTE: problems() refuses a field model's data.path

    def describe(self) -> tuple[str, str]:
        f = self.cfg.field_section()
        return (
            f"field model FieldNet {f.n_blocks} blocks x {f.hidden} channels",
            f"synthetic fields {f.channels} x {f.height} x {f.width}",
        )

    def train_step(
        self,
        model: nn.Module,
        batch: Batch | FieldBatch,
        mesh: DeviceMesh,
        device: torch.device,
        ignore_token: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean squared error over every grid point (:func:`forge.field_step.field_step`)."""
        from ..data import FieldBatch
        from ..field_step import field_step

        assert isinstance(batch, FieldBatch)  # NOTE: data() gives field batches here
        return field_step(model, batch, mesh, device, self.cfg.training.grad_accum)

    def throughput(self) -> tuple[float | None, str, int]:
        """Points of the global batch's fields, and no MFU: a conv net's FLOPs are not 6 x
        parameters per item."""
        f = self.cfg.field_section()
        return None, "pts/s", self.cfg.training.global_batch_size * f.height * f.width
