"""A Hugging Face causal language model's kind (``[model] hf = "DIR"``): transformers' own
model, built from the directory's config.json on the meta device, filled from its weights
(each rank reading only its slices) or, with ``pretrained = false``, from the seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

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

    from ..data import Batch, FieldBatch, StepData
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
        if par.pp > 1:
            problems.append(
                f"parallelism.pp={par.pp} with model.hf: forge-pp splits forge's own model into "
                "stages, not a Hugging Face model yet; set parallelism.pp=1"
            )
        problems += hf_compile_problems(True, par.tp, self.cfg.training.compile)
        if par.cp > 1:
            problems.append(
                f"parallelism.cp={par.cp} with model.hf: context parallelism runs forge's own "
                "attention, not a Hugging Face model's yet; set parallelism.cp=1"
            )
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
        return []  # NOTE: problems() refuses a pipeline

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
        """``data.tokenizer``, else the model directory when it holds a tokenizer."""
        given = self.cfg.data.tokenizer
        if given is not None:
            return given
        return self.hf.dir if has_tokenizer(self.hf.dir) else None

    def data(
        self, dp_rank: int, dp_size: int, *, image_token_id: int | None, image_tokens: int
    ) -> StepData[Batch] | StepData[FieldBatch]:
        """Text tokenized by the model's tokenizer (:mod:`forge.text_data`), a token file, or
        synthetic tokens."""
        text = self._text_data(dp_rank, dp_size, "train")
        if text is not None:
            return text
        return super().data(
            dp_rank, dp_size, image_token_id=image_token_id, image_tokens=image_tokens
        )

    def validation_data(self, dp_rank: int, dp_size: int) -> StepData[Batch] | None:
        """The held-out documents (``data.validation_fraction``) of text data."""
        return self._text_data(dp_rank, dp_size, "validation")

    def _text_data(self, dp_rank: int, dp_size: int, split: str) -> StepData[Batch] | None:
        """Split ``split`` of text ``data.path``, this rank's slices (None: not text)."""
        cfg, t = self.cfg, self.cfg.training
        if cfg.data.path is None:
            return None
        from ..text_data import TextData, is_text_data

        if not is_text_data(cfg.data.path):
            return None
        tokenizer = self.tokenizer_dir()
        assert tokenizer is not None  # NOTE: data_problems refused it before launch
        return TextData(
            cfg.data,
            tokenizer_dir=tokenizer,
            seq_len=t.seq_len,
            global_batch=t.global_batch_size,
            seed=t.seed,
            cache_dir=self.cache_dir(),
            dp_rank=dp_rank,
            dp_size=dp_size,
            split=split,
        )

    def cache_dir(self) -> str:
        """Where tokenized text is kept: ``data.cache_dir``, else ``<out_dir>/token_cache``."""
        import os

        return self.cfg.data.cache_dir or os.path.join(self.cfg.training.out_dir, "token_cache")

    def data_problems(self) -> list[str]:
        """Text: the tokenizer, the columns, the template and the vocabulary, tokenizing once
        (the ranks then read the cache); a token file as for forge's model."""
        cfg, t = self.cfg, self.cfg.training
        if cfg.data.path is None:
            return []
        from ..text_data import is_text_data, text_data_problems

        if not is_text_data(cfg.data.path):
            return super().data_problems()
        return text_data_problems(
            cfg.data,
            tokenizer_dir=self.tokenizer_dir(),
            vocab_size=cfg.model.vocab_size,
            seq_len=t.seq_len,
            seed=t.seed,
            cache_dir=self.cache_dir(),
        )

    def describe(self) -> tuple[str, str]:
        config = read_hf_config(self.hf.dir)
        m, t = self.cfg.model, self.cfg.training
        weights = "pretrained" if self.hf.pretrained else "random init"
        model = (
            f"Hugging Face {config.get('model_type', '?')} {self.hf.dir} ({weights}; "
            f"{m.n_layers} layers x dim {m.dim})"
        )
        return model, f"{self.cfg.data.path or 'synthetic tokens'}, seq {t.seq_len}"

    def train_step(
        self,
        model: nn.Module,
        batch: Batch | FieldBatch,
        mesh: DeviceMesh,
        device: torch.device,
        ignore_token: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step of :meth:`DecoderKind.train_step`, with packed text's positions (attention
        kept inside each document) and loss mask."""
        from forge_core.training import forward_backward

        from ..data import FieldBatch

        assert not isinstance(batch, FieldBatch)  # NOTE: data() gives token batches here
        return forward_backward(
            model,
            batch.tokens.to(device),
            mesh=mesh,
            grad_accum=self.cfg.training.grad_accum,
            positions_BS=None if batch.positions is None else batch.positions.to(device),
            loss_mask_BS=None if batch.loss_mask is None else batch.loss_mask.to(device),
        )

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
