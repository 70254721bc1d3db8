"""Pure checks of a vision-language layout (no torch import: a launcher runs them on the config
before any rank starts). The config checks themselves (:func:`check_vlm`) live with the configs
in :mod:`forge_vlm.config`."""

from __future__ import annotations

from forge_core.errors import ForgeConfigError, did_you_mean

from .config import AC_SCOPES

__all__ = ["ac_components"]


def ac_components(scope: str, frozen_encoder: bool = False) -> tuple[str, ...]:
    """The components ``ac_scope`` checkpoints (``all`` | ``language`` | ``vision``).

    A frozen encoder keeps no activations for backward, so checkpointing it saves nothing: it
    is left out of ``all``, and ``vision`` alone is refused.
    """
    table = {"all": ("encoder", "decoder"), "language": ("decoder",), "vision": ("encoder",)}
    if scope not in table:
        raise ForgeConfigError(
            f"ac_scope={scope!r} is invalid: choose one of {list(AC_SCOPES)}"
            + did_you_mean(str(scope), AC_SCOPES)
        )
    if frozen_encoder and scope == "vision":
        raise ForgeConfigError(
            "ac_scope='vision' with a frozen encoder: the encoder keeps no activations for "
            "backward, so checkpointing it saves nothing; use ac_scope='language' or 'all'"
        )
    return tuple(c for c in table[scope] if not (frozen_encoder and c == "encoder"))
