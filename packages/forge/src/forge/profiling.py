"""One step of ``forge train`` under ``torch.profiler`` (``metrics.profile_step``).

Where a step's time goes is the first question after a slow run (the GPU round measured
``forge train`` at 31-36% MFU where the same model's bare step reached 52.6%), and it should
not need a code change to answer. With ``metrics.profile_step = N`` every rank profiles its
step ``N`` (1-based, as ``metrics.jsonl`` counts) and writes, under
``<training.out_dir>/profile/``:

- ``step-N-rank-R.txt``: torch's operator table twice, the top rows by device time (CUDA) and by
  CPU time, each with its share of the step;
- ``step-N-rank-R.json``: the Chrome trace of the step (open it in Perfetto or chrome://tracing).

The profiled step runs slower than the others (the profiler records every operator); its
``metrics.jsonl`` line is marked ``"profiled": true`` so that throughput readers can leave it out.
A resumed run that starts past ``N`` profiles nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["StepProfiler"]

#: Rows of each operator table in the text file.
TABLE_ROWS = 30


class StepProfiler:
    """Profiles one step of a training loop: ``with profiler.step(done): ...`` around each step,
    where ``done`` is the 1-based number of the step being run; only step ``at`` is profiled
    (``at = 0``: none)."""

    def __init__(self, at: int, out_dir: str | Path, rank: int, device: torch.device) -> None:
        self.at = at
        self.folder = Path(out_dir) / "profile"
        self.rank = rank
        self.device = device
        self.written: list[Path] = []

    def step(self, done: int) -> _ProfiledStep:
        """A context manager around step ``done``: the profiler when ``done`` is the step asked
        for, else nothing."""
        return _ProfiledStep(self, done if done == self.at else None)

    def _activities(self) -> list[ProfilerActivity]:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        return activities

    def _write(self, prof: profile, done: int) -> None:
        """The operator tables and the trace of step ``done``, one pair of files per rank."""
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"step-{done}-rank-{self.rank}"
        averages = prof.key_averages()
        sections = [f"forge train: step {done}, rank {self.rank}, device {self.device}"]
        if self.device.type == "cuda":
            sections += ["", "## by device time", ""]
            sections.append(averages.table(sort_by="self_device_time_total", row_limit=TABLE_ROWS))
        sections += ["", "## by CPU time", ""]
        sections.append(averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS))
        text = stem.with_suffix(".txt")
        text.write_text("\n".join(sections) + "\n")
        trace = stem.with_suffix(".json")
        prof.export_chrome_trace(str(trace))
        self.written += [text, trace]


class _ProfiledStep:
    """The context of one step: starts and stops the profiler around step ``done`` (None: a
    step that is not profiled, a no-op)."""

    def __init__(self, owner: StepProfiler, done: int | None) -> None:
        self.owner = owner
        self.done = done
        self.prof: profile | None = None

    @property
    def active(self) -> bool:
        return self.done is not None

    def __enter__(self) -> _ProfiledStep:
        if self.done is not None:
            if self.owner.device.type != "cuda":
                # NOTE: kineto logs "gpuGetDeviceCount failed" as an ERROR when a CPU-only
                # profile starts on a machine without a GPU driver; harmless, and alarming in a
                # run's output. Level 5 keeps its errors out unless the user set a level.
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")
            self.prof = profile(activities=self.owner._activities(), record_shapes=False)
            self.prof.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.prof is None or self.done is None:
            return
        if self.owner.device.type == "cuda":
            torch.cuda.synchronize(self.owner.device)  # the step's kernels inside the window
        self.prof.__exit__(kind, err, tb)
        if kind is None:  # a failed step's partial profile is not worth a file
            self.owner._write(self.prof, self.done)
