"""``metrics.profile_step``: forge train runs one step under ``torch.profiler`` and every rank
writes its operator tables and Chrome trace; the step is marked in ``metrics.jsonl``; a step
the run never takes is refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from forge.checks import config_problems
from forge.config import load_config
from forge.train import run_train
from forge_core.errors import ForgeConfigError


def _cfg(out: Path, steps: int, profile_step: int) -> dict:
    return {
        "model": {"preset": "debug"},
        "parallelism": {"dp_shard": 2},
        "training": {"steps": steps, "out_dir": str(out), "warmup_steps": 1},
        "checkpoint": {"save_at_end": False, "resume": "none"},
        "metrics": {"profile_step": profile_step},
    }


def _train(cfg: dict) -> list[int]:
    return [s.step for s in run_train(cfg, "cpu").steps]


def test_the_asked_step_is_profiled_on_every_rank(run_on_ranks, tmp_path):
    run_on_ranks(2, _train, _cfg(tmp_path, steps=3, profile_step=2))
    folder = tmp_path / "profile"
    assert sorted(p.name for p in folder.iterdir()) == [
        f"step-2-rank-{r}.{ext}" for r in (0, 1) for ext in ("json", "txt")
    ]
    for rank in (0, 1):
        table = (folder / f"step-2-rank-{rank}.txt").read_text()
        assert table.startswith(f"forge train: step 2, rank {rank}, device cpu")
        assert "## by CPU time" in table and "aten::mm" in table  # the step's own matmuls
        trace = json.loads((folder / f"step-2-rank-{rank}.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert "aten::mm" in names and "Optimizer.step#AdamW.step" in names
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    marked = {r["step"]: r.get("profiled", False) for r in lines if "loss" in r}
    assert marked == {1: False, 2: True, 3: False}


def test_no_profile_step_writes_no_profile(run_on_ranks, tmp_path):
    run_on_ranks(2, _train, _cfg(tmp_path, steps=2, profile_step=0))
    assert not (tmp_path / "profile").exists()


def test_a_profile_step_past_the_run_is_refused_before_launch(tmp_path):
    cfg = load_config(_cfg(tmp_path, steps=3, profile_step=4))
    problems = config_problems(cfg, 2)
    assert any(p.startswith("metrics.profile_step=4 is past training.steps=3") for p in problems)
    assert not config_problems(load_config(_cfg(tmp_path, steps=3, profile_step=3)), 2)


def test_a_negative_profile_step_is_refused(tmp_path):
    with pytest.raises(ForgeConfigError, match="metrics.profile_step"):
        load_config(_cfg(tmp_path, steps=3, profile_step=-1))
