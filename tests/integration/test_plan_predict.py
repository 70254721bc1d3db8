"""``forge plan --gpu NAME --format json``: the peak-memory and step-time predictions
(forge.plan_predict) hold together, follow the hardware and the layout the way they must, and
refuse an unknown GPU in one line. (Their accuracy against measured runs is issue 34's
benchmark, not this file.)"""

from __future__ import annotations

import json

import pytest
from forge import load_config
from forge.plan import plan_layout, run_plan
from forge.plan_predict import gpu_names, load_gpu, predict_memory, predict_time
from forge_core import ForgeConfigError

KEYS = {"peak_bytes", "peak_rank", "step_seconds", "tokens_per_second_per_gpu", "mfu", "breakdown"}
LLAMA_8B = [
    "model.preset=llama3_8b",
    "parallelism.tp=1",
    "training.seq_len=8192",
    "training.global_batch_size=8",
    "training.param_dtype=bfloat16",
]


def _json(capsys, world: int, overrides: list[str], gpu: str | None = "h100-sxm") -> dict:
    assert run_plan(None, world, overrides, gpu=gpu, output="json") == 0
    return json.loads(capsys.readouterr().out)


def test_every_profile_loads_with_sane_numbers():
    assert {"h100-sxm", "h200", "b200", "a100-80gb"} <= set(gpu_names())
    for name in gpu_names():
        gpu = load_gpu(name)
        assert gpu.name == name and gpu.memory_bytes > 40 * 2**30
        assert gpu.fp8_flops >= gpu.bf16_flops > 1e14
        assert gpu.nvlink_bytes_per_s > gpu.network_bytes_per_s > 0
        for efficiency in (gpu.matmul_efficiency, gpu.attention_efficiency, gpu.comm_efficiency):
            assert 0 < efficiency <= 1


def test_an_unknown_gpu_is_one_line_naming_the_known_ones(capsys):
    with pytest.raises(ForgeConfigError, match="did you mean 'h100-sxm'"):
        load_gpu("h100-sxn")
    assert run_plan(None, 4, [], gpu="v100") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "h100-sxm" in err


def test_json_has_the_stable_keys_and_its_numbers_add_up(capsys):
    out = _json(capsys, 8, ["parallelism.tp=2"])
    assert set(out) >= KEYS
    assert out["peak_bytes"] == sum(out["breakdown"].values())
    assert 0 <= out["peak_rank"] < 8 and out["fits"] is True
    tokens = 8 * 32  # the defaults, which the output names
    assert out["tokens_per_second_per_gpu"] * out["step_seconds"] * 8 == pytest.approx(tokens)
    assert 0 < out["mfu"] < 1
    assert "training.seq_len=32" in out["defaults"]
    without = _json(capsys, 8, ["parallelism.tp=2"], gpu=None)
    assert without["peak_bytes"] == out["peak_bytes"] and without["step_seconds"] is None


def test_the_peak_holds_each_ranks_static_bytes():
    plan = plan_layout(load_config(None, ["parallelism.tp=2"]), 8)
    peak = predict_memory(plan)
    static = max(
        p + g + o
        for p, g, o in zip(plan.padded_param_bytes, plan.grad_bytes, plan.optim_bytes, strict=True)
    )
    assert peak.peak_bytes > static
    assert peak.breakdown["params"] == plan.padded_param_bytes[peak.peak_rank]


def test_time_follows_the_hardware_and_the_layout():
    plan = plan_layout(load_config(None, [*LLAMA_8B, "training.ac_mode=full"]), 8)
    h100, a100 = (predict_time(plan, load_gpu(n)) for n in ("h100-sxm", "a100-80gb"))
    assert a100.step_seconds > 2 * h100.step_seconds  # 312 vs 989 TFLOP/s
    assert h100.dominant == "compute" and 0.2 < h100.mfu < 0.8
    no_ac = predict_time(plan_layout(load_config(None, LLAMA_8B), 8), load_gpu("h100-sxm"))
    assert no_ac.compute_seconds < h100.compute_seconds  # AC full recomputes the forward


def test_a_group_across_nodes_pays_the_network():
    """tp is innermost: on 16 ranks as dp_shard 8 x tp 2 a tp group spans 2 neighbouring ranks,
    a dp_shard group 16 (two nodes of 8): the same call takes the network's time there."""
    from forge.plan_predict import _call_seconds, _strides
    from forge_core.costs import Collective

    plan = plan_layout(load_config(None, ["parallelism.tp=2"]), 16)
    groups = _strides(plan.mesh, 1)
    assert groups["tp"] == (1, 2) and groups["dp_shard"] == (2, 16)
    gpu = load_gpu("h100-sxm")
    call = Collective("forward", "all_gather", "dp_shard", 8, 2**30, 1, "test")
    inside, across = _call_seconds(call, gpu, 8), _call_seconds(call, gpu, 16)
    ratio = gpu.nvlink_bytes_per_s / gpu.network_bytes_per_s
    assert across - gpu.latency_s == pytest.approx(ratio * (inside - gpu.latency_s))


def test_a_model_too_big_for_the_gpu_is_said_not_to_fit(capsys):
    out = _json(capsys, 1, [*LLAMA_8B, "parallelism.data=none"], gpu="a100-80gb")
    assert out["fits"] is False and out["peak_bytes"] > load_gpu("a100-80gb").memory_bytes
    assert run_plan(None, 1, [*LLAMA_8B, "parallelism.data=none"], gpu="a100-80gb") == 0
    assert "does NOT fit" in capsys.readouterr().out


SMALL_RUN = ["model.preset=small", "training.seq_len=256", "training.global_batch_size=64"]


def test_search_ranks_fitting_layouts_and_matches_the_exact_plan(capsys):
    """``--search`` plans each candidate at a data-parallel degree of 8 and scales back: for
    FSDP2 over 32 ranks its prediction equals the exact plan's within 2 %; the rows come
    fitting first, fastest first, and every candidate keeps the rules."""
    import dataclasses

    from forge.checks import config_problems
    from forge.plan_search import candidate_layouts, run_search, search_layouts

    cfg = load_config(None, SMALL_RUN)
    gpu = load_gpu("h100-sxm")
    tables = candidate_layouts(cfg, 32, gpu)
    assert {
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "data": "fsdp2",
        "dp_shard": 32,
        "dp_replicate": 1,
    } in tables
    for table in tables:
        trial = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, **table))
        assert config_problems(trial, 32) == []
        assert (
            table["tp"] * table["pp"] * table["cp"] * table["dp_shard"] * table["dp_replicate"]
            == 32
        )
    rows, tried = search_layouts(cfg, 32, gpu)
    assert tried == len(tables) and rows
    speeds = [r.tokens_per_second_per_gpu for r in rows if r.fits]
    assert speeds == sorted(speeds, reverse=True)
    fsdp = next(r for r in rows if r.layout["dp_shard"] == 32)
    exact = plan_layout(load_config(None, [*SMALL_RUN, "parallelism.tp=1"]), 32)
    peak, step = predict_memory(exact), predict_time(exact, gpu)
    assert fsdp.peak_bytes == pytest.approx(peak.peak_bytes, rel=0.02)
    assert fsdp.tokens_per_second_per_gpu == pytest.approx(step.tokens_per_second_per_gpu, rel=0.02)
    assert run_search(None, 32, SMALL_RUN, gpu="h100-sxm", output="json") == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best[0]["tokens_per_second_per_gpu"] == rows[0].tokens_per_second_per_gpu


def test_search_needs_a_gpu(capsys):
    from forge.plan_search import run_search

    assert run_search(None, 8, []) == 2
    assert "--search ranks layouts by predicted speed on a GPU" in capsys.readouterr().err
