"""``[pp]``: pipeline schedule settings (pure Python, no torch import).

The pipeline degree itself is ``parallelism.pp``; this section says how the stages run.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_core.errors import ForgeConfigError, check_field_types, check_int, did_you_mean

__all__ = ["SCHEDULES", "PPConfig", "ScheduleInfo"]


@dataclass(frozen=True)
class ScheduleInfo:
    """What forge needs to know of a schedule: torch's class, how many stages a rank holds
    (``"one"``, ``"several"``: interleaved/looped, ``"two"``: V-shaped) and where the stages go
    (``"loop"``: stage ``s`` on rank ``s % pp``; ``"v"``: rank ``r`` holds ``r`` and ``2pp-1-r``)."""

    torch_class: str
    stages_per_rank: str
    placement: str
    one_f_one_b: bool  # a 1F1B-family schedule: needs at least as many micro-batches as ranks


#: Schedule names (as torch and torchtitan spell them) -> what forge needs to know of them.
SCHEDULES: dict[str, ScheduleInfo] = {
    "GPipe": ScheduleInfo("ScheduleGPipe", "one", "loop", False),
    "1F1B": ScheduleInfo("Schedule1F1B", "one", "loop", True),
    "Interleaved1F1B": ScheduleInfo("ScheduleInterleaved1F1B", "several", "loop", True),
    "LoopedBFS": ScheduleInfo("ScheduleLoopedBFS", "several", "loop", False),
    "InterleavedZeroBubble": ScheduleInfo("ScheduleInterleavedZeroBubble", "several", "loop", True),
    "ZBVZeroBubble": ScheduleInfo("ScheduleZBVZeroBubble", "two", "v", True),
    "DualPipeV": ScheduleInfo("ScheduleDualPipeV", "two", "v", True),
}


@dataclass(frozen=True)
class PPConfig:
    """Pipeline parallelism (forge-pp): ``[pp]`` section; used when ``parallelism.pp > 1``.

    ``schedule``: one of :data:`SCHEDULES` (case does not matter). ``microbatches``: micro-batches
    per optimizer step, each rank's batch split along the batch dimension (0: one per stage,
    ``pp x stages_per_rank``). ``stages_per_rank``: 1 for GPipe / 1F1B, 2 or more for the
    interleaved and looped schedules, 2 for the V-shaped ones (ZBVZeroBubble, DualPipeV); 0 picks
    that. ``split_points``: the block indices where stages 1, 2, ... begin (empty: balanced, the
    embedding and the final norm + head each weighing one block).
    """

    schedule: str = "1F1B"
    microbatches: int = 0
    stages_per_rank: int = 0
    split_points: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_field_types(self, "pp")
        names = {name.lower(): name for name in SCHEDULES}
        canonical = names.get(str(self.schedule).lower())
        if canonical is None:
            raise ForgeConfigError(
                f"pp.schedule={self.schedule!r} is not a schedule forge knows: choose one of "
                f"{list(SCHEDULES)}" + did_you_mean(str(self.schedule), SCHEDULES)
            )
        object.__setattr__(self, "schedule", canonical)
        object.__setattr__(self, "split_points", tuple(self.split_points))
        for name in ("microbatches", "stages_per_rank"):
            if getattr(self, name) < 0:
                raise ForgeConfigError(
                    f"pp.{name}={getattr(self, name)} must be >= 0 (0 picks the default)"
                )
            check_int(f"pp.{name}", getattr(self, name), 0)

    @property
    def info(self) -> ScheduleInfo:
        return SCHEDULES[self.schedule]

    def local_stages(self) -> int:
        """Stages per rank, the default resolved."""
        if self.stages_per_rank:
            return self.stages_per_rank
        return 1 if self.info.stages_per_rank == "one" else 2

    def num_microbatches(self, pp: int) -> int:
        """Micro-batches per step on ``pp`` pipeline ranks, the default resolved."""
        return self.microbatches or pp * self.local_stages()
