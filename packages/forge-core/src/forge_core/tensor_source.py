"""Where one model tensor's values lie in a checkpoint that names or lays them out otherwise.

A :class:`TensorSource` is the contract between the layer that knows a layout (forge_moe_ep
knows how a Hugging Face MoE checkpoint stores the experts forge's MoE stacks) and the layer
that reads files (forge_checkpoint reads each rank's slices of them): plain data, no torch, so
that neither layer imports the other and the pre-launch checks can use it before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TensorSource"]


@dataclass(frozen=True)
class TensorSource:
    """How to read one model tensor (the *target*) from a checkpoint's tensors.

    ``stored``: the checkpoint's tensor names it is read from. With ``stacked``, ``stored[i]``
    holds row ``i`` of the target's dim 0 (one tensor per expert, stacked as they are read), so
    the stored tensors have one dim fewer than the target; without it, ``stored`` is one name
    holding the whole target (same dim 0: experts stay experts). Empty: nothing is stored for
    it, and the target is ``constant`` everywhere.

    ``transpose``: the stored tensors' last two dims are the target's, swapped (a per-expert
    ``nn.Linear`` weight ``[out, in]`` read into stacked ``[E, in, out]``).

    ``part`` of ``parts``: the stored last dim (after ``transpose``) holds ``parts`` tensors of
    the target's last dim side by side (``interleaved=False``: ``[gate | up]``) or alternating
    (``interleaved=True``: ``gate, up, gate, up, ...``, GPT-OSS); the target is number
    ``part`` of them. With ``parts == 1`` the last dim is the target's.
    """

    stored: tuple[str, ...]
    stacked: bool = False
    transpose: bool = False
    part: int = 0
    parts: int = 1
    interleaved: bool = False
    constant: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.part < self.parts:
            raise ValueError(f"TensorSource: part {self.part} of {self.parts}")
        if not self.stored and self.constant is None:
            raise ValueError("TensorSource: no stored tensor and no constant")
        if len(self.stored) > 1 and not self.stacked:
            raise ValueError("TensorSource: several stored tensors are stacked (stacked=True)")

    @property
    def rename(self) -> str | None:
        """The stored name when the target is that tensor as it is, under another name."""
        plain = not (self.stacked or self.transpose) and self.parts == 1
        return self.stored[0] if plain and len(self.stored) == 1 else None

    def stored_shape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        """The shape each of :attr:`stored` has for a target of shape ``target`` (what the
        checks compare with the checkpoint's headers)."""
        shape = list(target[1:] if self.stacked else target)
        if shape:
            shape[-1] *= self.parts
        if self.transpose and len(shape) >= 2:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        return tuple(shape)

    def last_dim(self, width: int, start: int, size: int) -> tuple[int, int, int]:
        """``(start, stop, step)`` in the stored last dim (after ``transpose``) of the target's
        last-dim range ``[start, start + size)``, its full last dim being ``width``."""
        if self.interleaved:
            first = start * self.parts + self.part
            return first, first + (size - 1) * self.parts + 1, self.parts
        first = self.part * width + start
        return first, first + size, 1
