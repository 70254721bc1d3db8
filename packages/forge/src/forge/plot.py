"""``forge plot RUN_DIR``: charts of a ``forge train`` run from its ``metrics.jsonl``.

Provides :func:`read_metrics` (the run's steps as one :class:`RunMetrics`), :func:`plot_run`
(one PNG per quantity: loss.png, grad_norm.png, lr.png, throughput.png, memory.png) and the
CLI hooks :func:`add_plot_parser` and :func:`run_plot`.

Notable choices:

- The file is read as the run wrote it, appended to by every resume: a ``start`` line with
  ``start_step`` S begins a new stretch of the run, so the earlier lines at steps after S (and
  their validation points) are dropped: a resume repeats them, and those it has not reached
  again yet belong to a trajectory that the checkpoint undid. Within that, the later line for a
  step wins. ``end`` lines and events this module does not know are ignored.
- A torn last line (a run killed mid-write, or one still writing) is skipped silently, and so
  is a torn fragment that a resume's ``start`` line was appended to (the resume writes on the
  unfinished line); an unreadable line anywhere else means a damaged file and is refused with
  its line number.
- Charts are drawn on ``matplotlib.figure.Figure`` with the Agg canvas directly, not through
  pyplot: no window ever opens and no process-wide backend is switched. matplotlib is imported
  only when a chart is drawn (it is the optional ``forge-parallel[metrics]``).
- Only the five chart files are written (overwritten if there); nothing is deleted.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from forge_core.errors import ForgeConfigError

__all__ = [
    "CHART_NAMES",
    "RunMetrics",
    "add_plot_parser",
    "plot_run",
    "read_metrics",
    "run_plot",
]

#: The files :func:`plot_run` writes, in its order.
CHART_NAMES = ("loss.png", "grad_norm.png", "lr.png", "throughput.png", "memory.png")

#: The number fields every step line holds.
_STEP_NUMBERS = ("loss", "grad_norm", "lr", "throughput")

_MATPLOTLIB_MISSING = "forge plot needs matplotlib: pip install 'forge-parallel[metrics]'"

_GIB = 2**30


@dataclass(frozen=True)
class RunMetrics:
    """A run's steps in step order, one entry per step after resumes are resolved.

    ``peak_mem_bytes`` holds every rank's peak per step; ``mfu`` is None where the run could not
    estimate it. ``validation`` is ``(step, loss)`` pairs in step order. ``throughput_unit`` is
    the newest ``start`` line's (``"tok/s"`` for language models).
    """

    path: Path
    steps: tuple[int, ...]
    loss: tuple[float, ...]
    grad_norm: tuple[float, ...]
    lr: tuple[float, ...]
    throughput: tuple[float, ...]
    peak_mem_bytes: tuple[tuple[int, ...], ...]
    mfu: tuple[float | None, ...]
    throughput_unit: str
    validation: tuple[tuple[int, float], ...]

    @property
    def peak_mem_max_bytes(self) -> tuple[int, ...]:
        """Per step, the largest rank's peak memory: the rank that runs out first."""
        return tuple(max(ranks, default=0) for ranks in self.peak_mem_bytes)


def _is_number(value: Any) -> bool:
    """An int or float from JSON (``bool`` is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _record_problem(record: Any) -> str | None:
    """What is wrong with one parsed line, or None for a line :func:`read_metrics` can use."""
    if not isinstance(record, dict):
        return f"holds {type(record).__name__}, not a JSON object"
    event = record.get("event")
    if event == "validation":
        if not _is_step(record.get("step")) or not _is_number(record.get("loss")):
            return "is a validation line without an integer 'step' >= 1 and a number 'loss'"
        return None
    if event is not None:
        return None  # start, end and future events: read where they matter, else ignored
    if not _is_step(record.get("step")):
        return "is a step line without an integer 'step' >= 1"
    missing = [k for k in _STEP_NUMBERS if not _is_number(record.get(k))]
    memory = record.get("peak_mem_bytes")
    if not isinstance(memory, list) or not all(_is_number(m) for m in memory):
        missing.append("peak_mem_bytes")
    mfu = record.get("mfu")
    if mfu is not None and not _is_number(mfu):
        missing.append("mfu")
    if missing:
        return f"is a step line whose {', '.join(missing)} is missing or not a number"
    return None


#: How ``forge train`` begins a start line (``json.dumps`` with its default separators).
_START_PREFIX = '{"event": "start"'


def _parse(line: str) -> Any:
    """One line's JSON; a torn line with a resumed run's start line glued on is that start line.

    NOTE: a run killed mid-line leaves the line without its newline, so the resume's first
    write lands on the same line: the start line is whole after the fragment.
    """
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        glued = line.rfind(_START_PREFIX)
        if glued <= 0:
            raise
        return json.loads(line[glued:])


def _records(path: Path) -> list[dict]:
    """The parsed lines of ``path``, blank lines and a torn last line left out."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as err:
        raise ForgeConfigError(f"cannot read {path}: {err.strerror or err}") from None
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    records = []
    for position, (number, line) in enumerate(numbered):
        try:
            record = _parse(line)
        except json.JSONDecodeError as err:
            if position == len(numbered) - 1:
                break  # NOTE: a run killed (or still writing) mid-line: the lines before count
            raise ForgeConfigError(
                f"{path}:{number} is not JSON ({err.msg}): the file is damaged; "
                "delete or repair that line and run forge plot again"
            ) from None
        problem = _record_problem(record)
        if problem is not None:
            raise ForgeConfigError(
                f"{path}:{number} {problem}: not a line forge train writes; "
                "delete or repair that line and run forge plot again"
            )
        records.append(record)
    return records


def _metrics_file(run_dir: Path) -> Path:
    """``run_dir/metrics.jsonl``, or the one-line reason ``run_dir`` is not a run directory."""
    fix = "pass training.out_dir of a forge train run"
    if not run_dir.exists():
        raise ForgeConfigError(f"run directory {run_dir} does not exist; {fix}")
    if not run_dir.is_dir():
        raise ForgeConfigError(f"{run_dir} is a file, not a run directory; {fix}")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ForgeConfigError(
            f"{run_dir} is not a forge train run directory (no metrics.jsonl); "
            "pass training.out_dir of a run"
        )
    return path


def read_metrics(run_dir: str | Path) -> RunMetrics:
    """Read ``<run_dir>/metrics.jsonl`` into one :class:`RunMetrics`.

    Raises :class:`ForgeConfigError` (one line) for a missing run directory, one without
    ``metrics.jsonl``, a file with no step line yet, and a damaged line (with its number).
    """
    path = _metrics_file(Path(run_dir))
    steps: dict[int, dict] = {}
    validation: dict[int, float] = {}
    unit = "items/s"
    for record in _records(path):
        event = record.get("event")
        if event == "start":
            unit = str(record.get("throughput_unit") or unit)
            start = record.get("start_step")
            if isinstance(start, int) and not isinstance(start, bool):
                steps = {s: r for s, r in steps.items() if s <= start}
                validation = {s: v for s, v in validation.items() if s <= start}
        elif event == "validation":
            validation[record["step"]] = float(record["loss"])
        elif event is None:
            steps[record["step"]] = record
    if not steps:
        raise ForgeConfigError(
            f"{path} has no step lines yet; run forge plot once the run has finished a step"
        )
    ordered = [steps[s] for s in sorted(steps)]
    return RunMetrics(
        path=path,
        steps=tuple(sorted(steps)),
        loss=tuple(float(r["loss"]) for r in ordered),
        grad_norm=tuple(float(r["grad_norm"]) for r in ordered),
        lr=tuple(float(r["lr"]) for r in ordered),
        throughput=tuple(float(r["throughput"]) for r in ordered),
        peak_mem_bytes=tuple(tuple(int(m) for m in r["peak_mem_bytes"]) for r in ordered),
        mfu=tuple(None if r.get("mfu") is None else float(r["mfu"]) for r in ordered),
        throughput_unit=unit,
        validation=tuple(sorted(validation.items())),
    )


class _Chart(NamedTuple):
    """One chart: its file, title, y label, values per step and the validation points drawn."""

    name: str
    title: str
    ylabel: str
    values: tuple[float, ...]
    from_zero: bool = False  # NOTE: rates and sizes start at 0, so noise does not look like a trend
    validation: tuple[tuple[int, float], ...] = ()


def _charts(run: RunMetrics) -> list[_Chart]:
    """Every chart of ``run``, in :data:`CHART_NAMES` order."""
    memory_gib = tuple(b / _GIB for b in run.peak_mem_max_bytes)
    return [
        _Chart("loss.png", "loss", "loss", run.loss, validation=run.validation),
        _Chart("grad_norm.png", "gradient norm (before clipping)", "grad norm", run.grad_norm),
        _Chart("lr.png", "learning rate", "lr", run.lr, from_zero=True),
        _Chart(
            "throughput.png",
            "throughput (whole job)",
            run.throughput_unit,
            run.throughput,
            from_zero=True,
        ),
        _Chart("memory.png", "peak memory (largest rank)", "GiB", memory_gib, from_zero=True),
    ]


def _draw(path: Path, chart: _Chart, steps: tuple[int, ...], run_name: str) -> None:
    """Write one line chart (with its validation points, if any) as a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)  # NOTE: Agg without pyplot: no window, no global backend switch
    axes = figure.add_subplot()
    # NOTE: a marker on each point while there are few, so one step still shows as a dot.
    marker = "." if len(steps) <= 50 else None
    axes.plot(steps, chart.values, marker=marker, linewidth=1.2, label="train")
    if chart.validation:
        axes.plot(
            [s for s, _ in chart.validation],
            [v for _, v in chart.validation],
            linestyle="none",
            marker="o",
            color="tab:orange",
            label="validation",
        )
        axes.legend()
    if chart.from_zero:
        axes.set_ylim(bottom=0)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes.set_title(f"{chart.title}: {run_name}")
    axes.set_xlabel("step")
    axes.set_ylabel(chart.ylabel)
    axes.grid(True, alpha=0.3)
    figure.savefig(path, format="png")


def _out_dir(run_dir: Path, out: str | Path | None) -> Path:
    """The chart folder, made if needed; a file there, or one that cannot be made, is refused."""
    folder = run_dir / "plots" if out is None else Path(out)
    if folder.exists() and not folder.is_dir():
        raise ForgeConfigError(f"--out {folder} is a file; pass a directory for the charts")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ForgeConfigError(
            f"cannot make --out {folder}: {err.strerror or err}; pass a writable directory"
        ) from None
    return folder


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the run's charts as PNGs into ``out`` (default ``<run_dir>/plots``); their paths.

    One file each for loss (with the validation points), gradient norm, learning rate,
    throughput and peak memory (the largest rank's, in GiB), named as :data:`CHART_NAMES`.
    Those names are overwritten; nothing else in ``out`` is touched.
    """
    run = read_metrics(run_dir)
    try:
        import matplotlib  # noqa: F401 - the optional dependency, checked before any file
    except ImportError:
        raise ForgeConfigError(_MATPLOTLIB_MISSING) from None
    folder = _out_dir(Path(run_dir), out)
    written = []
    for chart in _charts(run):
        path = folder / chart.name
        try:
            _draw(path, chart, run.steps, Path(run_dir).resolve().name)
        except OSError as err:
            raise ForgeConfigError(
                f"cannot write {path}: {err.strerror or err}; pass --out a writable directory"
            ) from None
        written.append(path)
    return written


def add_plot_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``forge plot RUN_DIR [--out DIR]`` to the ``forge`` command's subparsers."""
    plot = subparsers.add_parser(
        "plot",
        help="chart a forge train run's metrics.jsonl as PNGs: loss, grad norm, lr, "
        "throughput, peak memory",
        description="Read RUN_DIR/metrics.jsonl (resumes resolved: the later line for a step "
        "wins) and write loss.png, grad_norm.png, lr.png, throughput.png and memory.png. "
        "Needs matplotlib: pip install 'forge-parallel[metrics]'.",
    )
    plot.add_argument("run_dir", help="a forge train run directory (its training.out_dir)")
    plot.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="folder for the charts (default RUN_DIR/plots); only the five chart files are "
        "written there, overwritten if present",
    )


def run_plot(args: argparse.Namespace) -> int:
    """``forge plot``: print each written chart's path; 0, or 2 with one error line on stderr."""
    try:
        paths = plot_run(args.run_dir, args.out)
    except ForgeConfigError as err:
        print(f"forge plot: error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
