"""The reference decoder's kind: forge's Transformer, dense or with MoE blocks (``[model]``,
``[moe]``); the default answers that :mod:`~forge.kinds.vlm` and :mod:`~forge.kinds.field`
change where they differ."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from forge_pp.checks import pp_problems

from ..job_config import eos_id_problems, is_text_data

#: :meth:`DecoderKind.input_activation_bytes`' keys: bytes kept per AC mode, and recomputed.
INPUT_ACTIVATION_KEYS: tuple[str, ...] = ("none", "full", "selective", "op")
INPUT_ACTIVATION_KEYS += tuple(f"{m}_recompute" for m in INPUT_ACTIVATION_KEYS[1:])

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from forge_core import ParallelismConfig
    from torch.distributed.device_mesh import DeviceMesh

    from ..config import ForgeConfig
    from ..data import Batch, FieldBatch, StepData
    from ..layout import Layout

__all__ = ["DecoderKind"]


@dataclass(frozen=True)
class DecoderKind:
    """forge's reference Transformer, dense or with MoE blocks: the default kind, whose answers
    the other kinds change where they differ."""

    cfg: ForgeConfig
    #: the kind's name in forge_cp's checks
    name: ClassVar[str] = "transformer"
    #: what the reports call the decoder this kind trains
    label: ClassVar[str] = "model"
    #: what a first pipeline stage holds before the blocks
    first_stage: ClassVar[str] = "embedding"

    def problems(self, layout: Layout) -> list[str]:
        """What this kind cannot be combined with (pure; the layers' checks run beside it), and
        ``data.eos_id`` against the data and the vocabulary."""
        problems = eos_id_problems(self.cfg.data, self.cfg.model.vocab_size)
        domain = layout.parallelism.domain
        if domain > 1:
            problems.append(
                f"parallelism.domain={domain}: domain parallelism splits 2-D fields (conv nets), "
                "and this model is a token model. Train a field model (model.preset=debug_field, "
                "[field] section), or set domain=1"
            )
        return problems

    def pipeline_problems(self, layout: Layout) -> list[str]:
        """What cannot run with ``parallelism.pp > 1`` (pure): the ``[pp]`` section against the
        layout (forge_pp's own checks), and what forge composes around the stages: plain tensors
        between them (no sequence or loss parallelism), a rank model that is never called as a
        whole (no whole-model compile), and no packed documents (the stages pass no positions).
        ``data='ddp'`` is :func:`forge.checks.plan_problems`'."""
        cfg = self.cfg
        par, t, m = layout.parallelism, cfg.training, cfg.decoder
        problems = pp_problems(
            cfg.pp,
            pp=par.pp,
            n_layers=m.n_layers,
            batch_per_rank=layout.batch_per_rank,
            grad_accum=t.grad_accum,
            tie_embeddings=self.pipeline_refuses_tied() and m.tie_embeddings,
        )
        problems += layout.refused  # sequence / loss parallelism asked on the stages
        if t.compile and t.compile_scope == "model":
            problems.append(
                f"training.compile_scope='model' with parallelism.pp={par.pp}: a pipeline rank's "
                "model is never called as a whole (the schedule calls its stages); set "
                "training.compile_scope='blocks', which compiles each block of every stage"
            )
        if cfg.data.packs_documents:
            eos = "" if cfg.data.eos_id is None else f" with data.eos_id={cfg.data.eos_id}"
            problems.append(
                f"data.path={cfg.data.path!r}{eos} packs documents (positions restart at each "
                "document), which pipeline stages do not carry yet; set parallelism.pp=1"
            )
        return problems

    def pipeline_refuses_tied(self) -> bool:
        """Whether :meth:`pipeline_problems` says tied embeddings cannot be pipelined in
        ``model.tie_embeddings`` words (a kind whose own checks say it in theirs: False)."""
        return True

    def import_problems(self, layout: Layout) -> list[str]:
        """What importing the modules this kind's sections name finds (none here)."""
        return []

    def build_problems(self) -> list[str]:
        """Why ``forge build`` cannot check this kind against one device (it can)."""
        return []

    def plan_problems(self) -> list[str]:
        """Why ``forge plan`` cannot model this kind (it can)."""
        return []

    def hf_export_problems(self) -> list[str]:
        """Why this kind has no Hugging Face layout to export to (a dense decoder has Llama's;
        MoE blocks have none)."""
        if not self.cfg.decoder.custom_ffn_layers:
            return []
        return [
            "forge's MoE decoder has no Hugging Face layout (Llama has no MoE layer); export it "
            "with layout='safetensors'"
        ]

    def weights(self) -> str | None:
        """A Hugging Face directory whose weights fill the model (None: drawn from the seed)."""
        return None

    def data(
        self, dp_rank: int, dp_size: int, *, image_token_id: int | None, image_tokens: int
    ) -> StepData[Batch] | StepData[FieldBatch]:
        """The data source of ``forge train``: text tokenized by :meth:`tokenizer_dir`'s
        tokenizer (:mod:`forge.text_data`), the token file at ``data.path`` (its documents ended
        by ``data.eos_id`` when set), else synthetic tokens. ``image_*``: a VLM's placeholder
        (what its wrapper says)."""
        from ..data import SyntheticData, TokenFile

        text = self._text_data(dp_rank, dp_size, "train")
        if text is not None:
            return text
        cfg, t = self.cfg, self.cfg.training
        if cfg.data.path is None:
            return SyntheticData(cfg, dp_rank, dp_size)
        return TokenFile(
            cfg.data.path,
            cfg.data.dtype,
            seq_len=t.seq_len,
            global_batch=t.global_batch_size,
            vocab_size=cfg.model.vocab_size,
            seed=t.seed,
            dp_rank=dp_rank,
            dp_size=dp_size,
            eos_id=cfg.data.eos_id,
        )

    def validation_data(self, dp_rank: int, dp_size: int) -> StepData[Batch] | None:
        """The held-out documents (``data.validation_fraction``) of text data for
        ``metrics.validation_every`` (None: not text; the pre-launch check refuses asking for
        a validation loss without held-out documents)."""
        return self._text_data(dp_rank, dp_size, "validation")

    def tokenizer_dir(self) -> str | None:
        """The tokenizer of text data: ``data.tokenizer`` (None: unset, which the pre-launch
        check refuses for text)."""
        return self.cfg.data.tokenizer

    def cache_dir(self) -> str:
        """Where tokenized text is kept: ``data.cache_dir``, else ``<out_dir>/token_cache``."""
        import os

        return self.cfg.data.cache_dir or os.path.join(self.cfg.training.out_dir, "token_cache")

    def _text_data(self, dp_rank: int, dp_size: int, split: str) -> StepData[Batch] | None:
        """Split ``split`` of text ``data.path``, this rank's slices (None: not text)."""
        cfg, t = self.cfg, self.cfg.training
        if cfg.data.path is None or not is_text_data(cfg.data.path):
            return None
        from ..text_data import TextData

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

    def data_problems(self) -> list[str]:
        """What the launcher says of the training data before any rank starts: text (the
        tokenizer, the columns, the template and the vocabulary, tokenizing once so that the
        ranks then read the cache: :func:`forge.text_data.text_data_problems`), or the token
        file at ``data.path`` (:func:`forge.data.token_file_problems`); nothing of synthetic
        data."""
        cfg, t, path = self.cfg, self.cfg.training, self.cfg.data.path
        if path is None:
            return []
        if is_text_data(path):
            from ..text_data import text_data_problems

            return text_data_problems(
                cfg.data,
                tokenizer_dir=self.tokenizer_dir(),
                vocab_size=cfg.model.vocab_size,
                seq_len=t.seq_len,
                seed=t.seed,
                cache_dir=self.cache_dir(),
            )
        from ..data import token_file_problems

        try:
            return token_file_problems(
                path, cfg.data.dtype, seq_len=t.seq_len, vocab_size=cfg.model.vocab_size
            )
        except OSError as e:  # NOTE: checked readable a moment ago; an I/O error while reading
            return [f"data.path={path!r} cannot be read: {e.strerror}"]

    def describe(self) -> tuple[str, str]:
        """``(model, data)`` as ``forge train``'s summary names them."""
        m, t = self.cfg.decoder, self.cfg.training
        model = f"model {m.n_layers} layers x dim {m.dim} ({m.num_params():,} parameters)"
        return model, f"{self.cfg.data.path or 'synthetic tokens'}, seq {t.seq_len}"

    def throughput(self) -> tuple[float | None, str, int]:
        """``(training FLOPs per item or None, the unit of items per second, items per step)``
        for ``forge train``'s rate and MFU: tokens of the global batch."""
        from ..train_console import train_flops_per_token

        t = self.cfg.training
        return train_flops_per_token(self.cfg), "tok/s", t.global_batch_size * t.seq_len

    def train_step(
        self,
        model: nn.Module,
        batch: Batch | FieldBatch,
        mesh: DeviceMesh,
        device: torch.device,
        ignore_token: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step's forward and backward on this rank's ``batch`` (what
        :meth:`data` gives): ``(loss sum, global count)``. ``ignore_token``: a VLM's placeholder,
        which the loss skips. Packed documents' positions (attention kept inside each document)
        and loss mask go with the tokens."""
        from forge_core.training import forward_backward

        from ..data import FieldBatch

        assert not isinstance(batch, FieldBatch)  # NOTE: data() gives token batches here
        return forward_backward(
            model,
            batch.tokens.to(device),
            mesh=mesh,
            grad_accum=self.cfg.training.grad_accum,
            images=None if batch.images is None else batch.images.to(device),
            ignore_token=ignore_token,
            # NOTE: the positions stay on the host: forward_backward lays out context-parallel
            # shards from them without a device sync, and moves them to the device itself.
            positions_BS=batch.positions,
            loss_mask_BS=None if batch.loss_mask is None else batch.loss_mask.to(device),
        )

    # ------------------------------------------------------------------------ forge plan
    def checkpointed_components(self) -> tuple[str, ...]:
        """The components AC full wraps: the decoder's blocks."""
        return ("decoder",)

    def input_activation_bytes(
        self, *, b: int, s: int, dim: int, tp: int, itemsize: int
    ) -> dict[str, int]:
        """What the model keeps before its decoder blocks for ``b`` sequences of ``s`` tokens,
        besides the token ids, by AC mode (``none``, ``full``, ``selective``, ``op``) and what
        each mode's backward recomputes there at once (``<mode>_recompute``): none here."""
        return dict.fromkeys(INPUT_ACTIVATION_KEYS, 0)

    # ------------------------------------------------------------------------ forge build
    def build_steps(self, reference: nn.Module) -> tuple[torch.Tensor, dict[str, Any]]:
        """The synthetic token batches of ``forge build``'s parity run, and what else each
        training step takes (``reference``: the one-device model)."""
        from forge_core.training import synthetic_tokens

        t = self.cfg.training
        vocab = self.cfg.model.vocab_size
        return synthetic_tokens(t.seed, t.steps, t.global_batch_size, t.seq_len, vocab), {}

    def decoder_reports(
        self,
        model: nn.Module,
        batch: torch.Tensor,
        par: ParallelismConfig,
        device: torch.device,
        mesh: DeviceMesh,
    ) -> tuple[str | None, list[str] | None]:
        """``forge build``'s MoE line and TP-gradient check of the decoder (None: not made;
        every rank takes part)."""
        from ..build_report import moe_report, tp_gradient_report

        moe = None
        if self.cfg.decoder.moe_layers:
            moe = moe_report(self.cfg, par, model, batch, device, mesh)
        tp_grads = None
        if par.tp > 1 and par.pp == 1:
            tp_grads = tp_gradient_report(model, batch, mesh)
        return moe, tp_grads

    def part_lines(self, model: nn.Module, par: ParallelismConfig) -> list[str]:
        """The report's lines on the model's parts (none: it is one decoder)."""
        return []

    def tp_lines(self, model: nn.Module, par: ParallelismConfig) -> list[str]:
        """The report's ``tp:`` line: the decoder's applied plan."""
        from ..build_report import tp_description

        return ["tp:     " + tp_description(model, par)] if par.tp > 1 else []
