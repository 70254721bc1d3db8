"""What rank 0 of ``forge train`` records while it trains: ``metrics.jsonl`` (a start line,
one line per step, validation lines, an end line), TensorBoard event files when
``[metrics] tensorboard`` asks, the progress bar and the summary's steps.

One object, :class:`RunLog`, so the training loop calls ``log.step(...)`` and nothing else per
step; ``forge plot`` reads the same file (:mod:`forge.plot`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .tensorboard_log import TensorBoardLog
from .train_console import Progress, format_memory

if TYPE_CHECKING:
    from .config import ForgeConfig

__all__ = ["RunLog", "StepLog"]


@dataclass(frozen=True)
class StepLog:
    """One optimizer step as ``forge train`` reports it."""

    step: int  # 1-based: the number of optimizer steps done
    loss: float
    grad_norm: float
    lr: float
    throughput: float  # tokens/s (grid points/s for a field model), the whole job


@dataclass
class RunLog:
    """Rank 0's records of one ``forge train`` run (see the module docstring).

    ``flops_per_item`` (None: unknown) and ``peak`` (one device's peak FLOP/s, None: unknown) give
    the MFU; ``items_per_step`` over a step's seconds gives the throughput in ``unit``.
    """

    cfg: ForgeConfig
    start: dict[str, Any]
    unit: str
    items_per_step: int
    flops_per_item: float | None
    peak: float | None
    world_size: int
    steps: list[StepLog] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)
    _file: IO[str] | None = None
    _progress: Progress | None = None
    _board: TensorBoardLog | None = None

    def __post_init__(self) -> None:
        t = self.cfg.training
        Path(t.out_dir).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(t.out_dir) / "metrics.jsonl", "a")  # noqa: SIM115 - close()
        self._write({"event": "start", **self.start, "throughput_unit": self.unit})
        first = int(self.start["start_step"])
        self._progress = Progress(t.steps, first, t.log_every)
        if self.cfg.metrics.tensorboard:
            self._board = TensorBoardLog(t.out_dir, start_step=first)

    def _write(self, record: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def step(
        self,
        done: int,
        loss: float,
        grad_norm: float,
        lr: float,
        seconds: float,
        memory: list[int],
        *,
        profiled: bool = False,
    ) -> None:
        """Step ``done`` (1-based) took ``seconds``; ``memory``: every rank's peak bytes;
        ``profiled``: the step ran under the profiler (``metrics.profile_step``), so its time
        reads slow and its line says so."""
        tps = self.items_per_step / seconds
        record = StepLog(done, loss, grad_norm, lr, tps)
        self.steps.append(record)
        mfu = None
        if self.peak and self.flops_per_item:
            mfu = tps * self.flops_per_item / (self.peak * self.world_size)
        line = {**asdict(record), "peak_mem_bytes": memory, "mfu": mfu, "time": time.time()}
        self._write({**line, "profiled": True} if profiled else line)
        if self._board is not None:
            self._board.log_step(
                done,
                loss=loss,
                grad_norm=grad_norm,
                lr=lr,
                throughput=tps,
                unit=self.unit,
                peak_mem_bytes=memory,
                mfu=mfu,
            )
        text = (
            f"loss {loss:.4f} gnorm {grad_norm:.3f} {tps:,.0f} {self.unit} "
            + (f"MFU {mfu:.1%} " if mfu is not None else "")
            + f"{format_memory(memory)} lr {lr:.2e}"
        )
        assert self._progress is not None
        self._progress.update(text, done, self.cfg.training.steps)

    def validation_loss(self, step: int, loss: float) -> None:
        """The validation loss after ``step``."""
        self.validation.append((step, loss))
        self._write({"event": "validation", "step": step, "loss": loss, "time": time.time()})
        if self._board is not None:
            self._board.log_validation(step, loss)

    def close(self, end: dict[str, Any]) -> None:
        """The end line (``end``: what the run did), then every file closed."""
        assert self._progress is not None and self._file is not None
        self._progress.close()
        self._write({"event": "end", **end, "time": time.time()})
        self._file.close()
        if self._board is not None:
            self._board.close()
