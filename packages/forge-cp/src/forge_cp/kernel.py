"""What forge-cp's two attention kernels share: their call, the bounds on the keys a query may
see, and running outside ``torch.compile``.

Both kernels (:class:`~forge_cp.attention.ContextParallelAttention`, the all-gather, and
:class:`~forge_cp.heads.HeadParallelAttention`, the all-to-all over heads) take
``kernel(q [B, H, s, D], k [B, Hkv, s, D], v, enable_gqa=..., documents=None, window=None,
scale=None) -> [B, H, s, D]``: this rank's ``s = S / cp`` tokens attending causally across the
whole row, inside their packed documents and a sliding window when given
(:class:`KeyBounds`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from forge_core.documents import Documents

from .sequence import shard_sequence

__all__ = ["CPKernel", "KeyBounds", "check_document_order", "row_documents"]


@dataclass(frozen=True)
class KeyBounds:
    """What limits the keys a query sees besides causality, and the softmax scale, as the
    context-parallel kernels take them: packed ``documents``, a sliding ``window`` (each query
    sees itself and ``window - 1`` tokens before it), ``scale`` (None: ``head_dim ** -0.5``)."""

    documents: Documents | None = None
    window: int | None = None
    scale: float | None = None

    @property
    def masked(self) -> bool:
        """Whether the keys need a mask beyond causality (else the kernels' mask-free path)."""
        return self.documents is not None or self.window is not None

    def mask(self, length: int, cp: int, queries: slice, like: torch.Tensor) -> torch.Tensor:
        """The additive mask ``[B or 1, 1, q, length]`` (``like``'s dtype and device) of
        ``queries`` over the whole row held in the ranks' order
        (:meth:`forge_core.documents.Documents.mask`)."""
        documents = self.documents
        if documents is None:
            documents = row_documents(length, cp, like.device)
        check_document_order(documents, length)
        return documents.mask(queries, self.window, like.dtype)


@functools.lru_cache(maxsize=8)
def row_documents(length: int, cp: int, device: torch.device) -> Documents:
    """A row of one document of ``length`` tokens in the order the ``cp`` ranks hold it (the
    fixed pairing): what the kernels mask with when a sliding window asks for a mask and the
    row has no packed documents. Kept per shape, so its masks are made once for every layer
    and step."""
    index = torch.cat([shard_sequence(torch.arange(length), cp, r, dim=0) for r in range(cp)])
    starts = torch.zeros(1, length, dtype=torch.int64, device=device)
    return Documents(index.to(device), starts)


def check_document_order(documents: Documents, length: int) -> None:
    """Refuse documents that do not cover the whole sequence of ``length`` tokens the cp ranks
    hold together (e.g. a rank's own positions turned into documents, which would mask its
    keys as if they were the whole row)."""
    if documents.index.shape[0] != length:
        raise ValueError(
            f"context-parallel attention got documents of {documents.index.shape[0]} tokens for "
            f"a sequence of {length}: pass the whole row's documents in the ranks' order "
            "(forge_core.training.forward_backward does)"
        )


class CPKernel:
    """Base of the two kernels: the call :func:`forge_core.contracts.causal_attention` makes,
    run eagerly (a graph break at the collectives under ``torch.compile``). A subclass defines
    ``attend(q, k, v, enable_gqa, bounds)``."""

    #: keeps attention inside packed documents (``forge_core.contracts``' attention kernel)
    forge_documents = True

    def __init__(self, group: dist.ProcessGroup, rank: int, cp: int) -> None:
        self.group, self.rank, self.cp = group, rank, cp

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, bounds: KeyBounds
    ) -> torch.Tensor:
        raise NotImplementedError

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        enable_gqa: bool,
        documents: Documents | None = None,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``documents``: keep attention inside packed documents; ``window``: a sliding window
        of that many tokens (each sees itself and ``window - 1`` before it); ``scale``: the
        softmax scale (default ``head_dim ** -0.5``)."""
        bounds = KeyBounds(documents, window, scale)
        return _eager(type(self).attend)(self, q, k, v, enable_gqa, bounds)


@functools.cache
def _eager(attend: Callable[..., torch.Tensor]) -> Any:
    """``attend`` kept out of ``torch.compile``.

    NOTE: wrapped at the first call, not at import: ``torch.compiler.disable`` imports dynamo,
    which imports triton's language module (see
    :meth:`forge_cp.attention.ContextParallelAttention.attend_chunk`).
    """
    return torch.compiler.disable(attend)
