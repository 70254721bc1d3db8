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


MOE_EP4 = [
    "model.preset=debug_moe",
    "parallelism.tp=1",
    "parallelism.ep=4",
    "training.global_batch_size=64",
]


def test_a_routing_skew_grows_the_busiest_ranks_expert_rows_and_step(capsys):
    """--moe-skew F: the busiest EP rank's experts get F x the balanced routed rows: its
    permuted input and expert SwiGLU (d e + 4 moe_ffn e per row, per MoE block) grow by exactly
    that, its routed FLOPs and row all-to-alls by F; the report says the assumption."""
    cfg = load_config(None, MOE_EP4)
    balanced, skewed = (plan_layout(cfg, 8, moe_skew=skew) for skew in (1.0, 2.0))
    m, b, s = cfg.decoder, balanced.micro_batch, cfg.training.seq_len
    rows = b * s * m.top_k  # dropless: every token's top_k rows
    per_row = m.dim * 4 + 4 * m.moe_ffn_dim * 4  # float32
    extra = len(m.moe_layers) * rows * per_row
    assert skewed.activation_none[0] - balanced.activation_none[0] == extra
    gpu = load_gpu("h100-sxm")
    slow, fast = predict_time(skewed, gpu), predict_time(balanced, gpu)
    assert slow.compute_seconds > fast.compute_seconds
    assert slow.step_seconds > fast.step_seconds
    assert run_plan(None, 8, MOE_EP4, gpu="h100-sxm", moe_skew=2.0) == 0
    text = capsys.readouterr().out
    assert "routing: the busiest EP rank's experts get 2x the balanced routed rows" in text
    out = _json(capsys, 8, MOE_EP4)
    assert out["moe_skew"] == 1.0


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallelism.tp=1"],  # dense: no experts
        [*MOE_EP4[:-2], "parallelism.ep=1"],  # a rank's experts get all its rows
        [*MOE_EP4, "moe.moe_dispatch=capacity"],  # the buffer is capped
    ],
    ids=["dense", "moe-ep1", "capacity"],
)
def test_a_skew_changes_nothing_where_no_rank_gets_more_rows(capsys, overrides):
    assert run_plan(None, 8, overrides, gpu="h100-sxm", output="json", moe_skew=3.0) == 0
    skewed = json.loads(capsys.readouterr().out)
    balanced = _json(capsys, 8, overrides)
    assert skewed["peak_bytes"] == balanced["peak_bytes"]
    assert skewed["step_seconds"] == pytest.approx(balanced["step_seconds"])
    assert run_plan(None, 8, overrides, moe_skew=3.0) == 0
    assert "routing:" not in capsys.readouterr().out


@pytest.mark.parametrize("skew", [0.5, float("nan"), float("inf")])
def test_a_bad_skew_is_one_line_and_exit_2(capsys, skew):
    assert run_plan(None, 8, MOE_EP4, moe_skew=skew) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--moe-skew must be a number >= 1" in err


def test_the_peak_counts_the_configs_ac_mode():
    """Selective and op keep less than none and more than full; the peak adds one recomputed
    block (or attention) to what the forward keeps."""
    acts = {}
    for mode in ("none", "full", "selective", "op"):
        plan = plan_layout(load_config(None, ["parallelism.tp=1", f"training.ac_mode={mode}"]), 4)
        estimate = plan.activation
        assert estimate is not None
        assert plan.activation_kept[0] == estimate.saved(mode)
        assert plan.activation_peak[0] == estimate.peak(mode) >= estimate.saved(mode)
        assert predict_memory(plan).breakdown["activations"] == plan.activation_peak[0]
        acts[mode] = estimate.saved(mode)
    assert acts["full"] < acts["op"] < acts["selective"] < acts["none"]


def _profile_text(**changes: object) -> str:
    """h100-sxm's profile with ``changes`` (None: the field left out), as TOML."""
    from dataclasses import asdict

    fields = {**asdict(load_gpu("h100-sxm")), "name": "my-gpu", **changes}
    return "\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items() if v is not None)


def test_a_profile_file_plans_a_gpu_forge_does_not_ship(tmp_path, capsys):
    path = tmp_path / "my-gpu.toml"
    path.write_text(_profile_text(memory_bytes=96 * 10**9, latency_s=1e-3))
    gpu = load_gpu(str(path))
    assert gpu.name == "my-gpu" and gpu.memory_bytes == 96 * 10**9
    out = _json(capsys, 8, ["parallelism.tp=2"], gpu=str(path))
    assert out["gpu"] == "my-gpu" and out["gpu_memory_bytes"] == 96 * 10**9
    h100 = _json(capsys, 8, ["parallelism.tp=2"])  # a collective's latency: 15 us there
    assert out["step_seconds"] > h100["step_seconds"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"memory_bytes": None}, "missing fields ['memory_bytes']"),
        ({"turbo": 1}, "unknown fields ['turbo']"),
        ({"matmul_efficiency": 1.5}, "matmul_efficiency = 1.5 must be in (0, 1]"),
        ({"gpus_per_node": 0}, "gpus_per_node = 0 must be a positive integer"),
        ({"bf16_flops": "fast"}, "bf16_flops = 'fast' must be a positive number"),
        ({"gpus_per_node": True}, "gpus_per_node = True must be a positive integer"),
    ],
)
def test_a_bad_profile_file_is_one_line_naming_the_field(tmp_path, capsys, changes, message):
    path = tmp_path / "bad.toml"
    path.write_text(_profile_text(**changes))
    assert run_plan(None, 4, [], gpu=str(path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_an_unreadable_or_broken_profile_file_is_one_line(tmp_path, capsys):
    (tmp_path / "broken.toml").write_text("name = [")
    for path, message in (
        (tmp_path / "absent.toml", "cannot read the profile file"),
        (tmp_path / "broken.toml", "not valid TOML"),
    ):
        assert run_plan(None, 4, [], gpu=str(path)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
