"""``[tp]``: the tensor-parallel options of a job (pure Python, no torch import)."""

from __future__ import annotations

from dataclasses import dataclass

from forge_core.errors import (
    ForgeConfigError,
    auto_flag,
    check_auto_flag,
    check_field_types,
    freeze_strings,
)

__all__ = ["TPConfig"]


@dataclass(frozen=True)
class TPConfig:
    """Tensor-parallel options (used when ``parallelism.tp > 1``).

    ``plan``: an import path ``"package.module:NAME"`` of a plan dict or function; None chooses
    automatically. Importing runs code, so it happens only for modules listed in
    ``allow_import`` (module prefixes), which the person running forge grants (forge's
    ``--allow-import``, or a dict passed to ``load_config``): a config file cannot set it.
    ``sequence_parallel``: ``"auto"`` (on for registered plans unless embeddings are tied),
    true or false. ``loss_parallel``: keep logits vocab-sharded through the loss.
    """

    plan: str | None = None
    allow_import: tuple[str, ...] = ()
    sequence_parallel: bool | str = "auto"
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        check_field_types(self, "tp")
        check_auto_flag("tp.sequence_parallel", self.sequence_parallel)
        freeze_strings(self, "allow_import", "tp.allow_import", "module prefixes")
        if self.plan is not None and not isinstance(self.plan, str):
            raise ForgeConfigError(
                f"tp.plan={self.plan!r} must be an import path 'package.module:NAME'"
            )

    @property
    def sequence_parallel_flag(self) -> bool | None:
        """None for ``"auto"``, else the bool."""
        return auto_flag(self.sequence_parallel)
