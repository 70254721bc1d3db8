"""How a run ends: ranks die with their launcher, one run per directory, signals stop cleanly.

The tests marked ``lifecycle`` start whole ``forge train`` runs (2 ranks, tiny) and kill, signal,
lock out or starve them of disk: their own CI lane (``uv run pytest -m lifecycle``). The
others drive forge's launcher (:mod:`forge.launch`) with a few lines of Python on two ranks and
stay in the default suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from forge.launch import RankFailed, launch_local
from forge_checkpoint.files import read_train_state
from forge_checkpoint.lock import run_lock

ROOT = Path(__file__).resolve().parents[2]
HOOKS = Path(__file__).with_name("lifecycle")  # sitecustomize: a slow rank 0 (see there)
TINY = {"parallelism.tp": "1", "training.seq_len": "16"}


# ---- forge's launcher on two ranks (default suite) ----------------------------------------------


def _rank_job(cfg: dict, device: str) -> str:
    """What a test's rank does: ``cfg`` says which rank fails, and how."""
    rank = int(os.environ["RANK"])
    if cfg.get("raise") == rank:
        raise ValueError(f"rank {rank} cannot go on")
    if cfg.get("kill") == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg.get("hang") == rank:
        time.sleep(600)
    return f"rank {rank} of {os.environ['WORLD_SIZE']} on {device}"


def _launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **cfg: int) -> str:
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # launch_local extends it
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    return launch_local(_rank_job, cfg, "cpu", 2, tmp_path / "logs", preload=__name__)


def test_the_launcher_returns_rank_0s_result(tmp_path, monkeypatch):
    assert _launch(tmp_path, monkeypatch) == "rank 0 of 2 on cpu"


def test_a_failed_rank_is_one_line_and_a_hung_one_is_killed(tmp_path, monkeypatch):
    import forge.launch

    monkeypatch.setattr(forge.launch, "STRAGGLER_GRACE_S", 0.5)
    with pytest.raises(RankFailed) as failed:
        _launch(tmp_path, monkeypatch, **{"raise": 1, "hang": 0})
    line = str(failed.value)
    assert line.startswith("rank 1 exited with code 1: ValueError: rank 1 cannot go on (its log: ")
    assert line.endswith("; 1 other rank(s) stopped after it)"), line  # rank 0, killed
    log = Path(line.split("its log: ")[1].split(";")[0])
    assert "Traceback" in log.read_text() and log.is_relative_to(tmp_path / "logs")
    with pytest.raises(RankFailed, match=r"^rank 1 was killed by SIGKILL \(its log: "):
        _launch(tmp_path, monkeypatch, kill=1)


# ---- whole forge train runs (lifecycle lane) --------------------------------------------------------


class _Run:
    """``forge train --nproc 2`` in the background; its stdout read as it comes."""

    def __init__(self, out: Path, *, steps: int = 100_000, slow: Path | None = None, **sets: str):
        """``slow``: rank 0 ends 3 s after the other ranks, and notes it there (``lifecycle/``)."""
        sets = {**TINY, "training.steps": str(steps), "training.out_dir": f"'{out}'", **sets}
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        first = [str(HOOKS), str(ROOT)] if slow else [str(ROOT)]
        path = os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH")) if p)
        env = {"FORGE_TEST_SLOW_RANK0": str(slow)} if slow else {}
        self.out, self.lines, self.new_line = out, [], threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forge.cli", "train", "--nproc", "2", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": path, **env},
            cwd=out.parent,
        )
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            with self.new_line:
                self.lines.append(line)
                self.new_line.notify_all()

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        with self.new_line:
            seen = self.new_line.wait_for(
                lambda: (
                    any(x.startswith(f"step {step}/") for x in self.lines)
                    or self.proc.poll() is not None
                ),
                timeout,
            )
        assert seen and self.proc.poll() is None, "".join(self.err)[-3000:]

    def ranks(self) -> list[int]:
        """The ranks' pids (children of the launcher's forkserver), rank 0 first."""
        (server,) = [p for p in _children(self.proc.pid) if b"forkserver" in _cmdline(p)]
        ranks = sorted(_children(server))  # NOTE: started one after the other
        assert len(ranks) == 2, ranks
        return ranks

    def finish(self, timeout: float = 120) -> tuple[int, list[str]]:
        """Exit status and stderr lines; a launcher that does not end in time fails the test."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"forge train did not end within {timeout} s of being stopped")
        time.sleep(0.5)  # the reader threads drain the pipes
        return code, "".join(self.err).splitlines()

    def kill_all(self) -> None:
        """Leave nothing running, whatever the test found (ranks that outlived their launcher)."""
        for pid in [p for s in _children(self.proc.pid) for p in _children(s)]:
            _kill(pid)
        for pid in _children(self.proc.pid):
            _kill(pid)
        _kill(self.proc.pid)
        self.proc.wait()


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()  # state, ppid, ...
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) and int(stat[1]) == pid:
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != b"Z"  # a zombie has ended


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def runs():
    started: list[_Run] = []
    yield started
    for run in started:
        run.kill_all()


@pytest.mark.lifecycle
def test_kill_9_of_the_launcher_ends_its_ranks_and_frees_the_directories(tmp_path, runs):
    out = tmp_path / "run"
    runs.append(run := _Run(out))
    run.wait_for_step(3)
    ranks = run.ranks()
    os.kill(run.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(r) for r in ranks), "ranks outlived their launcher by 10 s"
    written = len(_metrics(out))
    time.sleep(2)
    assert len(_metrics(out)) == written  # nothing trains or logs on
    with run_lock({"training.out_dir": out, "checkpoint.dir": out / "checkpoints"}):
        pass  # free at once: no process of the run is left to hold it


@pytest.mark.lifecycle
def test_a_second_run_on_the_same_out_dir_is_refused_while_the_first_runs(tmp_path, runs):
    out = tmp_path / "run"
    runs.append(first := _Run(out))
    first.wait_for_step(2)
    # its own checkpoint.dir, the first run's out_dir: metrics and logs would interleave
    second = _Run(out, steps=2, **{"checkpoint.dir": f"'{tmp_path / 'other'}'"})
    runs.append(second)
    code, err = second.finish()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        f"forge train: config error: training.out_dir '{out}' is in use by another forge train "
        f"(pid {first.proc.pid}); wait for it to finish, or give this run its own training.out_dir"
    )
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish()[0] == 0


def _stopped_cleanly(run: _Run, marker: Path, who: str, *also: str) -> None:
    """The run ended by itself after a signal: exit 0, one status line, a checkpoint of the
    step it stopped after, although rank 0 ended 3 s after the other rank (which waits for no
    one: a rank that waited for the launcher to collect every rank's result could hang it).
    ``who``: what the status line names as the cause (``also``: other correct namings)."""
    code, err = run.finish()
    assert code == 0 and len(err) == 1, err
    end = _metrics(run.out)[-1]
    step = end["step"]
    checkpoint = run.out / "checkpoints" / f"step-{step:08d}"
    assert end["event"] == "end" and end["stopped_by"] in (who, *also) and step >= 3
    assert err[0] == (
        f"forge train: stopped by {end['stopped_by']} after step {step}; checkpoint "
        f"{checkpoint} (resume: run the same command again)"
    )
    assert read_train_state(checkpoint)["step"] == step
    assert marker.read_text() == "rank 0 reports 3 s late\n"


@pytest.mark.lifecycle
def test_sigterm_to_one_rank_saves_and_ends_the_run_cleanly(tmp_path, runs):
    marker = tmp_path / "slow-rank-0"
    runs.append(run := _Run(tmp_path / "run", slow=marker))
    run.wait_for_step(3)
    os.kill(run.ranks()[1], signal.SIGTERM)
    _stopped_cleanly(run, marker, "SIGTERM on rank 1")


@pytest.mark.lifecycle
def test_sigterm_to_the_launcher_saves_and_ends_the_run_cleanly(tmp_path, runs):
    marker = tmp_path / "slow-rank-0"
    runs.append(run := _Run(tmp_path / "run", slow=marker))
    run.wait_for_step(3)
    run.proc.send_signal(signal.SIGTERM)
    _stopped_cleanly(run, marker, "SIGTERM")


@pytest.mark.lifecycle
def test_sigterm_to_the_forkserver_saves_and_ends_the_run_cleanly(tmp_path, runs):
    """The ranks' forkserver is a process of the run too: a signal that ends it ends the run
    the clean way (before, its ranks, reparented, trained on)."""
    marker = tmp_path / "slow-rank-0"
    runs.append(run := _Run(tmp_path / "run", slow=marker))
    run.wait_for_step(3)
    (server,) = [p for p in _children(run.proc.pid) if b"forkserver" in _cmdline(p)]
    os.kill(server, signal.SIGTERM)
    # NOTE: each rank signals itself when it sees the forkserver gone (a watcher polling every
    # 0.25 s), so a step's vote can hold rank 1's signal before rank 0's: both namings are right
    _stopped_cleanly(run, marker, "SIGTERM", "SIGTERM on rank 1")


@pytest.mark.lifecycle
def test_a_signal_after_the_last_step_leaves_the_finished_run_alone(tmp_path, runs):
    """A SIGTERM that reaches a rank after its loop ended (here rank 0, writing its report) has
    nothing left to stop: the run ends as finished, exit 0. Before, the rank had put back the
    default handler and died of it, and the run failed ("rank 0 exited with code 255" when the
    signal was a rank's watcher noticing, late, that the forkserver had been stopped)."""
    marker = tmp_path / "slow-rank-0"
    runs.append(run := _Run(tmp_path / "run", steps=6, slow=marker))
    run.wait_for_step(1)
    rank_0 = run.ranks()[0]
    deadline = time.monotonic() + 240
    while not marker.exists() and run.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "".join(run.err)[-3000:]  # rank 0 is in its report: the loop ended
    os.kill(rank_0, signal.SIGTERM)
    code, err = run.finish()
    assert code == 0, err
    end = _metrics(run.out)[-1]
    assert end["event"] == "end" and end["step"] == 6 and end["stopped_by"] is None, end


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs (root: CI and the development machines run as root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a 1 MiB tmpfs (CI runs as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.lifecycle
def test_a_full_disk_is_one_line_naming_the_rank_and_the_directory(full_disk, runs):
    out = full_disk / "run"
    runs.append(run := _Run(out, steps=4, **{"checkpoint.every": "2"}))  # 1.6 MB > 1 MiB
    code, err = run.finish(timeout=240)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("forge train: FAIL: rank "), err
    assert f"OSError: [Errno 28] No space left on device: '{out / 'checkpoints'}'" in err[0]
