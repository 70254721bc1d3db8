"""Pre-launch checks of a ``[float8]`` section: settings that cannot work together, and whether
torchao imports here. No torch import at module level: a launcher runs them on the config before
any rank starts.

:func:`float8_problems` and :func:`torchao_problems` return every problem as a one-line message
(empty: fine); :func:`check_float8` and :func:`check_torchao` raise the first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from forge_core.errors import refuse

if TYPE_CHECKING:
    from .config import Float8Config

__all__ = ["check_float8", "check_torchao", "float8_problems", "torchao_problems"]


def float8_problems(float8: Float8Config, tp: int) -> list[str]:
    """Every ``[float8]`` setting that cannot work with ``tp`` (pure: no torch, no torchao)."""
    if not (float8.enabled and float8.fsdp_all_gather_flag):
        return []
    problems = []
    if tp > 1:
        problems.append(
            "float8.fsdp_float8_all_gather=true with tp > 1: torchao's float8 weight wrapper does "
            'not support TP (DTensor) weights; set it false or "auto"'
        )
    if float8.recipe != "tensorwise":
        problems.append(
            "float8.fsdp_float8_all_gather=true needs float8.recipe='tensorwise', got "
            f"{float8.recipe!r}"
        )
    return problems


def torchao_problems() -> list[str]:
    """``[message]`` when torchao does not import here (the lent GPU machines, for one, come
    without it), else ``[]``. Imports torchao, and torch for the message."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        import torch

        return [
            f"float8.enabled=true needs torchao, which does not import here ({exc}); install a "
            f"torchao release built for torch {torch.__version__.split('+')[0]} "
            "(`pip install torchao`), or set float8.enabled=false"
        ]
    return []


def check_float8(float8: Float8Config, tp: int, *, torchao: bool = True) -> None:
    """Refuse ``[float8]`` settings that cannot work with ``tp``; then, Float8 on and ``torchao``,
    a torchao that does not import (what is wrong in the file comes first). ``torchao=False``
    keeps it pure: no torch, no torchao import."""
    refuse(float8_problems(float8, tp))
    if float8.enabled and torchao:
        check_torchao()


def check_torchao() -> None:
    """Refuse Float8 up front when torchao does not import here (run before any rank
    starts; the lent GPU machines, for one, come without it)."""
    refuse(torchao_problems())
