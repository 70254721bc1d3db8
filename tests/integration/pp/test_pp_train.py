"""forge build and forge train with pipeline parallelism, and checkpoints across pipeline layouts.

The rank code of both commands (``run_build``, ``run_train``) runs on persistent gloo ranks.
A checkpoint saved under pp=2 x dp_shard=2 resumes under dp_shard=4 (no pipeline) and under
pp=4, continuing the uninterrupted run step for step: the rank model keeps the unsplit
parameter names, so DCP reshards between pipeline layouts as between any others.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from forge.job import run_build
from forge.train import run_train
from forge_checkpoint.dcp import SafeFileSystemReader
from forge_checkpoint.files import read_train_state
from forge_core import ModelConfig, Transformer

#: 4 blocks so that pp=4 gives each rank one; clipping active (every step's norm is above 1).
MODEL = {"preset": "debug", "n_layers": 4}
TRAIN = {"global_batch_size": 8, "seq_len": 16, "warmup_steps": 1, "lr": 3e-3}


def _cfg(out: Path, parallelism: dict, steps: int = 4, **sections: dict) -> dict:
    cfg: dict = {
        "model": dict(MODEL),
        "parallelism": {"tp": 1, **parallelism},
        "training": {**TRAIN, "steps": steps, "out_dir": str(out)},
        "checkpoint": {"every": 2, "save_at_end": False, "resume": "none"},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def _train(cfg: dict):
    return run_train(cfg, "cpu")


def _build(cfg: dict):
    return run_build(cfg, "cpu")


def _steps(summaries) -> list[tuple[int, float, float]]:
    return [(s.step, s.loss, s.grad_norm) for s in summaries[0].steps]


@pytest.fixture(scope="module")
def pipelined_run(run_on_ranks, tmp_path_factory) -> tuple[Path, list, list]:
    """forge train under pp=2 x dp_shard=2 for 4 steps, a checkpoint every 2."""
    out = tmp_path_factory.mktemp("pp2xdp2")
    summaries = run_on_ranks(4, _train, _cfg(out, {"pp": 2, "dp_shard": 2}))
    return out, summaries, _steps(summaries)


def test_forge_train_runs_logs_and_checkpoints_under_pp(pipelined_run):
    out, summaries, steps = pipelined_run
    assert [s for s, _, _ in steps] == [1, 2, 3, 4]
    assert all(g > 1.0 for _, _, g in steps), "clipping must be active"
    assert steps[-1][1] < steps[0][1]  # it learns
    # Every rank reports the same loss: the schedule's loss sum is reduced over the pp ranks.
    assert summaries[0].text.startswith("forge train: 4 rank(s) on cpu, pp=2 x dp_shard=2;")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["mesh"] == {"pp": 2, "dp_shard": 2}
    logged = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert logged == [(s, loss) for s, loss, _ in steps]
    assert all(len(r["peak_mem_bytes"]) == 4 for r in records if "loss" in r)
    assert records[-1]["event"] == "end" and records[-1]["step"] == 4


def test_a_pipelined_checkpoint_holds_every_parameter_under_its_unsplit_name(pipelined_run):
    out = pipelined_run[0]
    ckpt = out / "checkpoints" / "step-00000002"
    assert read_train_state(ckpt)["mesh"] == {"pp": 2, "dp_shard": 2}
    metadata = SafeFileSystemReader(ckpt).read_metadata().state_dict_metadata
    with torch.device("meta"):
        unsplit = Transformer(ModelConfig.preset("debug", n_layers=4)).state_dict()
    saved = {k.removeprefix("model."): v for k, v in metadata.items() if k.startswith("model.")}
    assert set(saved) == set(unsplit)  # every block from both pipeline ranks, no stage prefix
    for name, tensor in unsplit.items():
        assert tuple(saved[name].size) == tuple(tensor.shape), name  # global shapes, unsharded
    adam = {k for k in metadata if k.startswith("optim.") and k.endswith(".exp_avg")}
    assert adam == {f"optim.{name}.exp_avg" for name in unsplit}


@pytest.mark.parametrize(
    "layout",
    [{"dp_shard": 4}, {"pp": 4, "data": "none"}],
    ids=["pp1xdp_shard4", "pp4"],
)
def test_a_pipelined_checkpoint_resumes_under_another_pipeline_layout(
    run_on_ranks, pipelined_run, tmp_path, layout
):
    out, _, full = pipelined_run
    cfg = _cfg(tmp_path, layout)
    cfg["checkpoint"]["resume"] = str(out / "checkpoints" / "step-00000002")
    summary = run_on_ranks(4, _train, cfg)[0]
    assert summary.start_step == 2 and summary.resumed_from is not None
    resumed = _steps([summary])
    assert [s for s, _, _ in resumed] == [3, 4]
    reference = {step: (loss, gnorm) for step, loss, gnorm in full}
    for step, loss, gnorm in resumed:
        ref_loss, ref_gnorm = reference[step]
        assert abs(loss - ref_loss) <= 1e-4 * ref_loss, (step, loss, ref_loss)
        assert abs(gnorm - ref_gnorm) <= 1e-4 * ref_gnorm, (step, gnorm, ref_gnorm)


def test_an_unpipelined_checkpoint_resumes_under_pp(run_on_ranks, pipelined_run, tmp_path):
    """The other direction: saved by FSDP2 on 4 ranks, resumed by pp=2 x dp_shard=2."""
    _, _, full = pipelined_run
    saved = run_on_ranks(4, _train, _cfg(tmp_path / "dp4", {"dp_shard": 4}))
    assert [s for s, _, _ in _steps(saved)] == [1, 2, 3, 4]  # same steps: the same LR schedule
    cfg = _cfg(tmp_path / "pp2", {"pp": 2, "dp_shard": 2})
    cfg["checkpoint"]["resume"] = str(tmp_path / "dp4" / "checkpoints" / "step-00000002")
    resumed = _steps(run_on_ranks(4, _train, cfg))
    assert [s for s, _, _ in resumed] == [3, 4]
    for (step, loss, gnorm), (_, ref_loss, ref_gnorm) in zip(resumed, full[2:], strict=True):
        assert abs(loss - ref_loss) <= 1e-4 * ref_loss, (step, loss, ref_loss)
        assert abs(gnorm - ref_gnorm) <= 1e-4 * ref_gnorm, (step, gnorm, ref_gnorm)


def test_forge_build_under_pp_x_tp_matches_one_device_and_reports_the_stages_plan(run_on_ranks):
    cfg = {"model": dict(MODEL), "parallelism": {"pp": 2, "tp": 2}, "training": {"steps": 3}}
    reports = run_on_ranks(4, _build, cfg)
    assert all(r.passed for r in reports), reports[0].text
    text = reports[0].text
    assert "mesh:   pp=2 x tp=2  (data=none)" in text
    assert "stages: pp -> tp " in text
    tp = text.split("tp:     ", 1)[1].split("\nmoe:")[0].split("\ntrain:")[0]
    assert tp.startswith("stage 0: "), tp
    assert "sequence_parallel=False" in tp and "stage 1:" not in tp, tp  # rank 0: stage 0 only
    assert "not applied" not in text


def test_forge_build_of_a_pipelined_moe_model_reports_every_stage_s_moe_layers(run_on_ranks):
    cfg = {
        "model": {"preset": "debug_moe", "n_layers": 4},
        "parallelism": {"pp": 2, "tp": 1, "ep": 2},
        "training": {"steps": 2},
    }
    reports = run_on_ranks(4, _build, cfg)
    assert all(r.passed for r in reports), reports[0].text
    moe = next(line for line in reports[0].text.splitlines() if line.startswith("moe:"))
    # the MoE layers of both pipeline ranks (rank 0 holds two of the four)
    assert moe.startswith("moe:    4 MoE layers x 8 experts (top-2), ep=2"), moe


def test_forge_build_of_a_pipelined_vision_language_model(run_on_ranks):
    cfg = {
        "model": {"preset": "debug_vlm", "n_layers": 4},
        "parallelism": {"pp": 2, "tp": 1},
        "training": {"steps": 2},
    }
    reports = run_on_ranks(4, _build, cfg)
    assert all(r.passed for r in reports), reports[0].text
    assert "per component: encoder pp -> fsdp2; decoder pp -> fsdp2" in reports[0].text
