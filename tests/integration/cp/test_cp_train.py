"""forge train with context parallelism, and its checkpoint resumed without it.

A run under cp=2 saves every 2 steps; its step-2 checkpoint resumed under dp_shard=2 (no cp)
continues the cp run step for step: CP changes no parameter name or shape
(FSDP2 shards over dp_shard x cp, DCP reshards as between any two layouts).
"""

from __future__ import annotations

import json
from pathlib import Path

from forge.train import run_train

TRAIN = {"global_batch_size": 8, "seq_len": 16, "warmup_steps": 1, "lr": 3e-3}


def _cfg(out: Path, parallelism: dict, resume: str = "none") -> dict:
    return {
        "model": {"preset": "debug"},
        "parallelism": {"tp": 1, **parallelism},
        "training": {**TRAIN, "steps": 4, "out_dir": str(out)},
        "checkpoint": {"every": 2, "save_at_end": False, "resume": resume},
    }


def _train(cfg: dict):
    return run_train(cfg, "cpu")


def _steps(summary) -> list[tuple[int, float, float]]:
    return [(s.step, s.loss, s.grad_norm) for s in summary.steps]


def test_forge_train_under_cp_resumes_without_cp_step_for_step(run_on_ranks, tmp_path):
    out = tmp_path / "cp2"
    run = run_on_ranks(2, _train, _cfg(out, {"cp": 2}))[0]
    full = _steps(run)
    assert [s for s, _, _ in full] == [1, 2, 3, 4] and full[-1][1] < full[0][1]  # it learns
    assert run.text.startswith("forge train: 2 rank(s) on cpu, cp=2;"), run.text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["mesh"] == {"cp": 2}
    resume = str(out / "checkpoints" / "step-00000002")
    resumed = run_on_ranks(2, _train, _cfg(tmp_path / "dp2", {"dp_shard": 2}, resume))[0]
    assert resumed.start_step == 2
    for (step, loss, gnorm), (_, ref_loss, ref_gnorm) in zip(
        _steps(resumed), full[2:], strict=True
    ):
        assert abs(loss - ref_loss) <= 1e-4 * ref_loss, (step, loss, ref_loss)
        assert abs(gnorm - ref_gnorm) <= 1e-4 * ref_gnorm, (step, gnorm, ref_gnorm)
