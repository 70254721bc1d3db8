"""Packed documents: causal attention that stays inside each document.

A training row may hold several documents one after another (packed pretraining text, or a
token file whose documents end with EOS). Each token's position then counts from its own
document's start (``positions [B, S]``, restarting at 0), and a token may attend only to the
tokens of its document up to itself. In a row laid out in order, token ``i``'s document starts
at ``i - positions[i]``, so key ``j`` is allowed for query ``i`` exactly when

    ``i - positions[i] <= j <= i``

(a sliding window of ``w`` tokens raises the lower bound to ``i - w + 1``). That is all the
attention needs: :class:`Documents` carries, for every token of the whole sequence, its place in
the sequence (``index``) and where its document starts (``starts``), in the order the attention
holds the tokens. Without context parallelism that order is the sequence's; a context-parallel
rank may hold its tokens in a load-balanced order of its own (``forge_cp``), and the same rule
then masks its keys without putting them back in order.

The documents travel with the forward call (``Transformer.forward(..., positions=[B, S])``, and
down to each attention module as an argument), never as module state: activation
checkpointing's recompute and a pipeline's micro-batches each see the documents of their own
inputs.
"""

from __future__ import annotations

import torch

from .errors import ForgeConfigError

__all__ = ["Documents", "document_mask", "position_problem"]


class Documents:
    """The documents of one batch, as attention sees them.

    ``index [S]`` (int64): the place in the sequence of each token the attention holds, in the
    order it holds them (``arange(S)`` without context parallelism). ``starts [B, S]`` (int64):
    the place where that token's document starts, same order. Every cp rank gets the same two
    tensors (the whole sequence's), so each can mask the keys it gathers.

    :meth:`mask` makes each mask once per object: the model passes one object to every layer,
    so every layer's attention saves the same mask tensor for backward (one copy, not one per
    layer). A plain class, not a dataclass, so that FSDP2's input casting passes the object
    itself down (it rebuilds dataclasses field by field, which would drop the cache).
    """

    __slots__ = ("_masks", "index", "starts")

    def __init__(self, index: torch.Tensor, starts: torch.Tensor) -> None:
        self.index, self.starts = index, starts
        self._masks: dict[tuple[int | None, int | None, int | None, torch.dtype], torch.Tensor]
        self._masks = {}

    def __repr__(self) -> str:
        return f"Documents(index={tuple(self.index.shape)}, starts={tuple(self.starts.shape)})"

    @classmethod
    def from_positions(cls, positions_BS: torch.Tensor) -> Documents:
        """The documents of rows laid out in order whose tokens are at ``positions_BS`` of their
        documents (restarting at 0 where one starts). Computed on the positions' device, no
        host read."""
        if positions_BS.dim() != 2:
            raise ForgeConfigError(
                f"document positions must be [batch, seq], got shape {tuple(positions_BS.shape)}"
            )
        index = torch.arange(positions_BS.shape[1], device=positions_BS.device)
        return cls(index, index - positions_BS.to(torch.int64))

    def to(self, device: torch.device) -> Documents:
        """The same documents on ``device``."""
        return Documents(self.index.to(device), self.starts.to(device))

    def mask(self, queries: slice, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """:func:`document_mask` of these documents as SDPA's additive mask in ``dtype`` (0
        where allowed, -inf elsewhere), made once per ``(queries, window, dtype)``.

        NOTE: additive, not bool: SDPA turns a bool mask into a float one inside every call,
        and each layer's backward would then keep its own copy."""
        key = (queries.start, queries.stop, window, dtype)
        if key not in self._masks:
            allowed = document_mask(self, queries, window=window)
            additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            self._masks[key] = additive.masked_fill_(~allowed, float("-inf"))
        return self._masks[key]


def document_mask(
    documents: Documents | None,
    queries: slice,
    *,
    window: int | None = None,
    keys: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Which keys each query may see: bool ``[B or 1, 1, q, S]`` for SDPA's ``attn_mask``.

    ``queries``: the queries' slice of ``documents``' order (the whole of it for one device or
    the heads variant, a rank's own tokens for the all-gather variant); the keys are all ``S``
    tokens in that order. Key ``j`` is allowed for query ``i`` when ``lower(i) <= j <= i``,
    with ``lower`` the query's document start (0 without documents: pass ``documents=None``
    and ``keys=S``) raised to ``i - window + 1`` with a sliding window. A query always sees
    itself, so no row is empty.
    """
    if documents is None:
        if keys is None:
            raise ValueError("document_mask without documents needs keys=S")
        index = torch.arange(keys, device=device)
        starts = torch.zeros(1, keys, dtype=torch.int64, device=device)
    else:
        index, starts = documents.index, documents.starts
    q_index = index[queries]
    lower = starts[:, queries]
    if window is not None:
        lower = torch.maximum(lower, q_index - (window - 1))
    k_index = index[None, None, :]
    allowed = (k_index >= lower[:, :, None]) & (k_index <= q_index[None, :, None])
    return allowed[:, None]


def position_problem(positions_BS: torch.Tensor) -> str | None:
    """Why ``positions_BS`` (on the CPU) are not positions in packed documents, else None.

    Each row must start at 0 and each next position be 0 (a new document) or one more than the
    last. Asked where the positions are read on the host anyway (the training step), never on
    a device (that would wait for it).
    """
    if positions_BS.dim() != 2 or positions_BS.dtype.is_floating_point:
        return (
            "document positions must be integers [batch, seq], got "
            f"{positions_BS.dtype} {tuple(positions_BS.shape)}"
        )
    if positions_BS.numel() == 0:
        return None
    if bool((positions_BS[:, 0] != 0).any()):
        return "document positions must start each row at 0"
    step = positions_BS[:, 1:]
    ok = (step == 0) | (step == positions_BS[:, :-1] + 1)
    if not bool(ok.all()):
        return (
            "document positions must count up by one inside a document and restart at 0 where "
            "the next one starts"
        )
    return None
