"""The kinds of model a forge config describes, each told apart here and nowhere else.

A config builds one of four kinds of model, and :func:`model_kind` picks its
:class:`ModelKind` (the one test of the kind for a config). The rest of forge (the checks, the
data, the reports, ``forge plan`` and the training loop) asks the kind instead of testing it:

- :class:`DecoderKind`: forge's reference Transformer, dense or with MoE blocks (``[model]``,
  ``[moe]``);
- :class:`VLMKind`: a vision-language model (``forge_vlm.VLMWrapper``: ``[vision]``,
  ``[adapter]``, ``[vlm]``) around that decoder;
- :class:`FieldKind`: a field model (``forge_domain.FieldNet``, a conv net over 2-D fields:
  ``[field]``);
- :class:`HFKind`: a Hugging Face causal LM from a local directory (``[model] hf``).

What differs between models as modules (a Hugging Face model, a model with components) is
:mod:`forge.model_spec`'s. Pure Python on the config (no torch import): the launcher asks a kind
for its problems before any rank starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .decoder import DecoderKind
from .field import FieldKind
from .hf import HFKind
from .vlm import VLMKind

if TYPE_CHECKING:
    from ..config import ForgeConfig

__all__ = ["DecoderKind", "FieldKind", "HFKind", "ModelKind", "VLMKind", "model_kind"]


#: Every kind a config can describe.
ModelKind = DecoderKind | VLMKind | FieldKind | HFKind


def model_kind(cfg: ForgeConfig) -> ModelKind:
    """The kind of model ``cfg`` describes (its ``ForgeConfig`` holds the sections of one kind
    at most: a field model or a VLM, never both)."""
    if cfg.hf is not None:
        return HFKind(cfg)
    if cfg.field is not None:
        return FieldKind(cfg)
    if cfg.vlm is not None:
        return VLMKind(cfg)
    return DecoderKind(cfg)
