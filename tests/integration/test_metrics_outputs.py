"""forge train's metrics outputs besides metrics.jsonl: ``forge plot``'s reading of the file
(resumes resolved, a torn last line skipped, every refusal one line), its PNG charts and CLI
hook, and the TensorBoard event files read back with TensorBoard's own reader.

metrics.jsonl files are written by hand in the shapes forge.train writes them: no ranks start.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import pytest
from forge.plot import CHART_NAMES, add_plot_parser, plot_run, read_metrics, run_plot
from forge.tensorboard_log import (
    TENSORBOARD_MISSING,
    TensorBoardLog,
    tensorboard_problems,
    throughput_tag,
)
from forge_core.errors import ForgeConfigError

_missing = __import__("importlib").util.find_spec
#: The charts and event files need the optional forge[metrics] packages, which the lent GPU
#: machines' software lacks: there these tests skip (the missing-package lines are tested here).
needs_matplotlib = pytest.mark.skipif(_missing("matplotlib") is None, reason="no matplotlib")
needs_tensorboard = pytest.mark.skipif(_missing("tensorboard") is None, reason="no tensorboard")

GIB = 2**30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _start(start_step: int = 0, unit: str = "tok/s") -> dict:
    return {
        "event": "start",
        "run_id": f"run{start_step}",
        "time": 1000.0 + start_step,
        "world_size": 2,
        "mesh": {"dp_shard": 2},
        "device": "cpu",
        "start_step": start_step,
        "resumed_from": None if start_step == 0 else f"ckpt/step-{start_step:08d}",
        "throughput_unit": unit,
        "config": {"training": {"steps": 4}},
    }


def _step(step: int, loss: float, mfu: float | None = None) -> dict:
    return {
        "step": step,
        "loss": loss,
        "grad_norm": loss / 2,
        "lr": 0.001 * step,
        "throughput": 100.0 * step,
        "peak_mem_bytes": [step * GIB, step * GIB // 2],
        "mfu": mfu,
        "time": 2000.0 + step,
    }


def _validation(step: int, loss: float) -> dict:
    return {"event": "validation", "step": step, "loss": loss, "time": 3000.0 + step}


def _write(run_dir: Path, records: list, tail: str = "") -> Path:
    """Write ``records`` as metrics.jsonl lines (a str is written as the line itself)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in lines) + tail)
    return path


def _resumed_run(run_dir: Path) -> Path:
    """A run that reached step 5, crashed, and was resumed from its step-2 checkpoint to 4."""
    return _write(
        run_dir,
        [
            _start(0, unit="img/s"),
            _step(1, 4.0, mfu=0.25),
            _step(2, 3.0),
            _validation(2, 3.5),
            _step(3, 2.75),
            _step(4, 2.5),
            _validation(4, 2.625),
            _step(5, 2.25),
            _start(2),
            _step(3, 2.0),
            _validation(4, 1.875),
            _step(4, 1.5, mfu=0.5),
            {"event": "end", "run_id": "run2", "step": 4, "stopped_by": None, "time": 9.0},
        ],
    )


def test_read_metrics_resolves_a_resume_so_the_later_line_for_a_step_wins(tmp_path):
    path = _resumed_run(tmp_path / "run")
    run = read_metrics(tmp_path / "run")
    assert run.path == path
    # the crashed run's step 5 is past the resume's start: the checkpoint undid it
    assert run.steps == (1, 2, 3, 4)
    assert run.loss == (4.0, 3.0, 2.0, 1.5)
    assert run.grad_norm == (2.0, 1.5, 1.0, 0.75)
    assert run.lr == (0.001, 0.002, 0.003, 0.004)
    assert run.throughput == (100.0, 200.0, 300.0, 400.0)
    assert run.peak_mem_bytes == tuple((s * GIB, s * GIB // 2) for s in (1, 2, 3, 4))
    assert run.peak_mem_max_bytes == (GIB, 2 * GIB, 3 * GIB, 4 * GIB)
    assert run.mfu == (0.25, None, None, 0.5)
    assert run.throughput_unit == "tok/s"  # the newest start line's
    assert run.validation == ((2, 3.5), (4, 1.875))


def test_a_torn_last_line_is_skipped_and_the_lines_before_kept(tmp_path):
    _write(tmp_path, [_start(), _step(1, 2.0), _step(2, 1.0)], tail='{"step": 3, "loss": 0.')
    run = read_metrics(tmp_path)
    assert run.steps == (1, 2)
    assert run.loss == (2.0, 1.0)


def test_a_resumes_start_line_glued_to_a_torn_line_reads_as_that_start(tmp_path):
    torn = '{"step": 2, "loss": 1.' + json.dumps(_start(1, unit="seq/s"))
    _write(tmp_path, [_start(), _step(1, 2.0), torn, _step(2, 1.25)])
    run = read_metrics(tmp_path)
    assert run.steps == (1, 2)
    assert run.loss == (2.0, 1.25)
    assert run.throughput_unit == "seq/s"


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (
            [_start(), '{"step": 1, "lo', _step(2, 1.0)],
            r"metrics\.jsonl:2 is not JSON \(.*\): the file is damaged; delete or repair",
        ),
        ([_start(), "[1, 2]", _step(1, 1.0)], r"metrics\.jsonl:2 holds list, not a JSON object"),
        (
            [_start(), {**_step(1, 1.0), "loss": "high"}],
            r"metrics\.jsonl:2 is a step line whose loss is missing or not a number",
        ),
        (
            [_start(), {**_step(1, 1.0), "step": 0}],
            r"metrics\.jsonl:2 is a step line without an integer 'step' >= 1",
        ),
        (
            [_start(), _step(1, 1.0), {"event": "validation", "step": 1}],
            r"metrics\.jsonl:3 is a validation line without an integer 'step' >= 1 and a number",
        ),
        ([_start()], r"metrics\.jsonl has no step lines yet; run forge plot once the run has"),
        ([], r"metrics\.jsonl has no step lines yet"),
    ],
)
def test_a_damaged_or_empty_metrics_file_is_refused_in_one_line(tmp_path, records, message):
    _write(tmp_path, records)
    with pytest.raises(ForgeConfigError, match=message) as caught:
        read_metrics(tmp_path)
    assert "\n" not in str(caught.value)


def test_what_is_not_a_run_directory_is_refused_in_one_line(tmp_path):
    with pytest.raises(ForgeConfigError, match=r"run directory .*nowhere does not exist; pass"):
        read_metrics(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ForgeConfigError, match=r"file is a file, not a run directory; pass"):
        read_metrics(tmp_path / "file")
    with pytest.raises(
        ForgeConfigError,
        match=r"is not a forge train run directory \(no metrics\.jsonl\); pass training\.out_dir "
        r"of a run$",
    ):
        read_metrics(tmp_path)


@needs_matplotlib
def test_plot_run_writes_the_five_charts_as_pngs_and_touches_nothing_else(tmp_path):
    import matplotlib.image

    run_dir = tmp_path / "run"
    _resumed_run(run_dir)
    plots = run_dir / "plots"
    plots.mkdir()
    (plots / "notes.txt").write_text("mine")
    (plots / "loss.png").write_text("an older chart")
    paths = plot_run(run_dir)
    assert paths == [plots / name for name in CHART_NAMES]
    assert sorted(p.name for p in plots.iterdir()) == sorted([*CHART_NAMES, "notes.txt"])
    assert (plots / "notes.txt").read_text() == "mine"
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC, path
    image = matplotlib.image.imread(plots / "loss.png")
    assert image.shape == (450, 800, 4)
    assert image.std() > 0  # drawn on, not a blank canvas


@needs_matplotlib
def test_plot_run_writes_into_out_and_refuses_an_out_that_is_a_file(tmp_path):
    _write(tmp_path / "run", [_start(), _step(1, 1.0)])
    paths = plot_run(tmp_path / "run", tmp_path / "charts" / "new")
    assert [p.parent for p in paths] == [tmp_path / "charts" / "new"] * len(CHART_NAMES)
    assert not (tmp_path / "run" / "plots").exists()
    (tmp_path / "taken").write_text("x")
    with pytest.raises(ForgeConfigError, match=r"--out .*taken is a file; pass a directory"):
        plot_run(tmp_path / "run", tmp_path / "taken")


def test_plot_run_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    _write(tmp_path, [_start(), _step(1, 1.0)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(ForgeConfigError) as caught:
        plot_run(tmp_path)
    assert str(caught.value) == (
        "forge plot needs matplotlib: pip install 'forge-parallel[metrics]'"
    )
    assert not (tmp_path / "plots").exists()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="forge")
    add_plot_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@needs_matplotlib
def test_run_plot_prints_each_chart_path_and_returns_0(tmp_path, capsys):
    _write(tmp_path / "run", [_start(), _step(1, 1.0), _step(2, 0.5)])
    args = _parse(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    assert (args.command, args.out) == ("plot", str(tmp_path / "out"))
    assert run_plot(args) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines() == [str(tmp_path / "out" / name) for name in CHART_NAMES]
    assert printed.err == ""
    assert _parse(["plot", "somewhere"]).out is None


def test_run_plot_reports_a_refusal_as_one_line_and_returns_2(tmp_path, capsys):
    assert run_plot(_parse(["plot", str(tmp_path)])) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err == (
        f"forge plot: error: {tmp_path} is not a forge train run directory (no metrics.jsonl); "
        "pass training.out_dir of a run\n"
    )


@needs_tensorboard
def test_tensorboard_problems_are_none_here_and_one_line_without_the_package(monkeypatch):
    assert tensorboard_problems() == []
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert tensorboard_problems() == [
        "metrics.tensorboard = true needs the tensorboard package: pip install "
        "'forge-parallel[metrics]' (or set metrics.tensorboard = false)"
    ]


def test_a_tensorboard_log_without_torch_tensorboard_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ForgeConfigError) as caught:
        TensorBoardLog(tmp_path)
    assert str(caught.value).startswith(f"{TENSORBOARD_MISSING} (")
    assert "\n" not in str(caught.value)


def test_the_throughput_tag_names_the_unit():
    assert throughput_tag("tok/s") == "train/throughput_tok_per_s"
    assert throughput_tag("img/s") == "train/throughput_img_per_s"
    assert throughput_tag("samples per second") == "train/throughput_samples_per_second"


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``log_dir``'s event files as TensorBoard reads them: tag -> (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(log_dir))
    reader.Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
    }


def _log(tb: TensorBoardLog, step: int, loss: float, mfu: float | None = None) -> None:
    # NOTE: values exact in float32 (TensorBoard's scalar type), so they compare with ==.
    tb.log_step(
        step,
        loss=loss,
        grad_norm=loss / 4,
        lr=2.0**-10 * step,
        throughput=256.0 * step,
        unit="tok/s",
        peak_mem_bytes=[step * GIB, 3 * GIB],
        mfu=mfu,
    )


@needs_tensorboard
def test_tensorboard_log_writes_the_scalars_tensorboard_reads_back(tmp_path):
    with TensorBoardLog(tmp_path) as tb:
        _log(tb, 1, 4.0, mfu=0.25)
        _log(tb, 2, 3.0)
        _log(tb, 4, 2.0, mfu=0.5)
        tb.log_validation(2, 3.5)
        tb.log_validation(4, 2.5)
        tb.flush()
    assert tb.log_dir == tmp_path / "tensorboard"
    assert _scalars(tmp_path / "tensorboard") == {
        "train/loss": [(1, 4.0), (2, 3.0), (4, 2.0)],
        "train/grad_norm": [(1, 1.0), (2, 0.75), (4, 0.5)],
        "train/lr": [(1, 2.0**-10), (2, 2.0**-9), (4, 2.0**-8)],
        "train/throughput_tok_per_s": [(1, 256.0), (2, 512.0), (4, 1024.0)],
        "memory/peak_bytes_max": [(1, 3.0 * GIB), (2, 3.0 * GIB), (4, 4.0 * GIB)],
        "train/mfu": [(1, 0.25), (4, 0.5)],
        "validation/loss": [(2, 3.5), (4, 2.5)],
    }


@needs_tensorboard
def test_a_resumed_tensorboard_log_hides_the_earlier_runs_later_steps(tmp_path, caplog):
    with TensorBoardLog(tmp_path) as tb:
        for step in (1, 2, 3, 4):
            _log(tb, step, 8.0 - step)
    with TensorBoardLog(tmp_path, start_step=2) as tb:
        _log(tb, 3, 0.5)
    caplog.set_level(logging.ERROR)  # the reader logs each purge as a warning
    assert _scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 7.0), (2, 6.0), (3, 0.5)]
