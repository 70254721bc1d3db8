"""Pre-launch checks of a ``[float8]`` section: settings that cannot work together, and whether
torchao imports here. No torch import at module level: a launcher runs them on the config before
any rank starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from forge_core.errors import ForgeConfigError

if TYPE_CHECKING:
    from .config import Float8Config

__all__ = ["check_float8", "check_torchao"]


def check_float8(float8: Float8Config, tp: int, *, torchao: bool = True) -> None:
    """Refuse ``[float8]`` settings that cannot work with ``tp``; then, Float8 on and ``torchao``,
    a torchao that does not import (what is wrong in the file comes first). ``torchao=False``
    keeps it pure: no torch, no torchao import."""
    if float8.enabled and float8.fsdp_all_gather_flag and tp > 1:
        raise ForgeConfigError(
            "float8.fsdp_float8_all_gather=true with tp > 1: torchao's float8 weight wrapper does "
            'not support TP (DTensor) weights; set it false or "auto"'
        )
    if float8.enabled and float8.fsdp_all_gather_flag and float8.recipe != "tensorwise":
        raise ForgeConfigError(
            "float8.fsdp_float8_all_gather=true needs float8.recipe='tensorwise', got "
            f"{float8.recipe!r}"
        )
    if float8.enabled and torchao:
        check_torchao()


def check_torchao() -> None:
    """Refuse Float8 up front when torchao does not import here (run before any rank
    starts; the lent GPU machines, for one, come without it)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        import torch

        raise ForgeConfigError(
            f"float8.enabled=true needs torchao, which does not import here ({exc}); install a "
            f"torchao release built for torch {torch.__version__.split('+')[0]} "
            "(`pip install torchao`), or set float8.enabled=false"
        ) from None
