"""``[cp]``: how context parallelism attends (pure Python, no torch import).

The cp degree itself is ``parallelism.cp``; this section says which exact attention runs
across the shards.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_core.errors import ForgeConfigError, check_field_types, did_you_mean

__all__ = ["CP_VARIANTS", "CPConfig"]

#: The variants forge-cp runs: what each rank keeps of attention, and what moves.
CP_VARIANTS: dict[str, str] = {
    "allgather": "every rank all-gathers the whole sequence's keys and values (any head count)",
    "heads": "an all-to-all over heads: each rank attends over the whole sequence with "
    "1/cp of the heads (heads per tp rank divisible by cp); ~1/cp activation memory",
}


@dataclass(frozen=True)
class CPConfig:
    """Context parallelism (forge-cp): ``[cp]`` section; used when ``parallelism.cp > 1``.

    ``variant``: ``"allgather"`` (the default) or ``"heads"`` (:data:`CP_VARIANTS`). Ring
    attention is not built: ``"ring"`` is refused in one line naming the two that are.
    """

    variant: str = "allgather"

    def __post_init__(self) -> None:
        check_field_types(self, "cp")
        if self.variant == "ring":
            raise ForgeConfigError(
                "cp.variant='ring' is not built in forge: use 'heads' (an all-to-all over "
                "heads, activation memory ~1/cp) or 'allgather' (any head count)"
            )
        if self.variant not in CP_VARIANTS:
            raise ForgeConfigError(
                f"cp.variant={self.variant!r} is not a variant forge-cp runs: choose one of "
                f"{list(CP_VARIANTS)}" + did_you_mean(str(self.variant), CP_VARIANTS)
            )
