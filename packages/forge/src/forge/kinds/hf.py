"""A Hugging Face causal language model's kind (``[model] hf = "DIR"``): transformers' own
model, built from the directory's config.json on the meta device, filled from its weights
(each rank reading only its slices) or, with ``pretrained = false``, from the seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from forge_cp.checks import hf_cp_problems
from forge_pp.checks import hf_pp_problems

from ..hf_source import (
    HFModelConfig,
    exact_heads,
    has_tokenizer,
    hf_compile_problems,
    hf_dir_problems,
    read_hf_config,
)
from .decoder import DecoderKind

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from forge_core import ParallelismConfig
    from torch.distributed.device_mesh import DeviceMesh

    from ..layout import Layout

__all__ = ["HFKind"]


@dataclass(frozen=True)
class HFKind(DecoderKind):
    """A Hugging Face causal LM trained as it is (its own modules, its own ``_tp_plan``)."""

    label: ClassVar[str] = "Hugging Face model"
    name: ClassVar[str] = "hf"

    @property
    def hf(self) -> HFModelConfig:
        assert self.cfg.hf is not None  # NOTE: model_kind picks this kind only then
        return self.cfg.hf

    def problems(self, layout: Layout) -> list[str]:
        """What a Hugging Face model cannot be combined with yet, and a bad directory."""
        par = layout.parallelism
        problems = super().problems(layout) + hf_dir_problems(self.hf)
        problems += hf_compile_problems(True, par.tp, self.cfg.training.compile)
        if par.cp > 1 and not hf_dir_problems(self.hf):
            # NOTE: Llama, Qwen3, Gemma3 through transformers' attention interface; others by name
            problems += hf_cp_problems(read_hf_config(self.hf.dir), par.cp)
        return problems

    def import_problems(self, layout: Layout) -> list[str]:
        """transformers builds the model from config.json (on the meta device), and with
        ``pretrained`` the weights' names and shapes are the model's (tensor headers only),
        its MoE blocks converted as the layout will convert them (tp or ep > 1)."""
        from forge_checkpoint import hf_weight_problems
        from forge_core.errors import ForgeConfigError
        from forge_moe_ep.hf import convert_hf_moe

        from ..model_spec import hf_weight_sources
        from ..models import hf_meta_model

        if hf_dir_problems(self.hf):
            return []  # NOTE: problems() has said what is wrong with the directory
        try:
            model = hf_meta_model(self.hf.dir)
        except ForgeConfigError as err:
            return [str(err)]
        if not self.hf.pretrained:
            return []
        try:
            par = layout.parallelism  # NOTE: the resolved degrees (ep=-1 decided)
            if max(par.tp, par.ep) > 1:
                convert_hf_moe(model)  # NOTE: as forge.hf_prepare.prepare_hf will
        except ForgeConfigError as err:
            return [str(err)]
        try:
            sources = hf_weight_sources(model, self.hf.dir)
        except ForgeConfigError:
            sources = {}  # NOTE: unreadable weights: hf_weight_problems says so, in one line
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        tied = set()
        if getattr(model.config, "tie_word_embeddings", False):
            tied = {name for name in expected if name.startswith("lm_head.")}
        problems = hf_weight_problems(expected, self.hf.dir, tied=tied, sources=sources)
        return [f"model.hf: {p}" for p in problems]

    def pipeline_problems(self, layout: Layout) -> list[str]:
        """:class:`DecoderKind`'s, then what forge-pp says of this Hugging Face config (the
        family, tied embeddings, sliding windows: :func:`forge_pp.checks.hf_pp_problems`).
        Pretrained weights are checked by :meth:`import_problems` against the whole model, as at
        pp=1: each pipeline rank then reads its own stages' tensors."""
        par = layout.parallelism
        problems = super().pipeline_problems(layout)
        if not hf_dir_problems(self.hf):  # NOTE: else problems() says what is wrong with it
            problems += hf_pp_problems(read_hf_config(self.hf.dir), par.pp, model=self.hf.dir)
        return problems

    def pipeline_refuses_tied(self) -> bool:
        return False  # NOTE: hf_pp_problems says it in config.json's words

    def plan_problems(self) -> list[str]:
        if exact_heads(read_hf_config(self.hf.dir)):
            return []
        return [
            f"forge plan models attention as hidden_size / num_attention_heads wide heads; "
            f"model.hf={self.hf.dir!r} has heads of another width (head_dim), which it does not "
            "model yet"
        ]

    def hf_export_problems(self) -> list[str]:
        return []  # NOTE: its own layout (forge_checkpoint.hf_export)

    def weights(self) -> str | None:
        """The directory whose weights fill the model (None: random, from the seed)."""
        return self.hf.dir if self.hf.pretrained else None

    def tokenizer_dir(self) -> str | None:
        """``data.tokenizer``, else the model directory when it holds a tokenizer (text data
        and the train step are :class:`DecoderKind`'s)."""
        given = self.cfg.data.tokenizer
        if given is not None:
            return given
        return self.hf.dir if has_tokenizer(self.hf.dir) else None

    def describe(self) -> tuple[str, str]:
        config = read_hf_config(self.hf.dir)
        m, t = self.cfg.model, self.cfg.training
        weights = "pretrained" if self.hf.pretrained else "random init"
        model = (
            f"Hugging Face {config.get('model_type', '?')} {self.hf.dir} ({weights}; "
            f"{m.n_layers} layers x dim {m.dim})"
        )
        return model, f"{self.cfg.data.path or 'synthetic tokens'}, seq {t.seq_len}"

    def decoder_reports(
        self,
        model: nn.Module,
        batch: torch.Tensor,
        par: ParallelismConfig,
        device: torch.device,
        mesh: DeviceMesh,
    ) -> tuple[str | None, list[str] | None]:
        return None, None  # NOTE: the reports read forge's own modules

    def tp_lines(self, model: nn.Module, par: ParallelismConfig) -> list[str]:
        from forge_tp_plans import describe_tp_plan

        return ["tp:     " + describe_tp_plan(model)] if par.tp > 1 else []
