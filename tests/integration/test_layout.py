"""forge.layout: every decision derived from a config and a world size is made in one place.

The sequence-parallel default is the example the tests turn: the TP layer's rule
(``forge_tp_plans.checks.default_sequence_parallel``) is flipped in the process that runs
``forge build``'s and ``forge train``'s rank code and in the one that runs ``forge plan``, and
all three follow it, as does the resolved :class:`forge.layout.Layout` the checks read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from forge.config import load_config
from forge.layout import resolve_layout

#: dp_shard 2 x tp 2 on 4 ranks, tp.sequence_parallel = "auto"
AUTO = {"model": {"preset": "debug"}, "parallelism": {"tp": 2}, "training": {"steps": 1}}


def _flip_rule(sp_on: bool):  # noqa: ANN202
    import forge_tp_plans.checks as tp_checks

    original = tp_checks.default_sequence_parallel
    tp_checks.default_sequence_parallel = lambda **_: sp_on
    return lambda: setattr(tp_checks, "default_sequence_parallel", original)


def _build_and_train_under_rule(cfg: dict, out: str, sp_on: bool) -> tuple[str, str]:
    """forge build's and forge train's rank code with the SP rule flipped; their tp lines."""
    from forge.job import run_build
    from forge.train import run_train

    restore = _flip_rule(sp_on)
    try:
        build = run_build(cfg)
        train = run_train({**cfg, "training": {**cfg["training"], "out_dir": out}})
    finally:
        restore()
    tp_line = [line for line in build.text.splitlines() if line.startswith("tp:")]
    train_line = [line for line in train.text.splitlines() if line.startswith("tp:")]
    return (tp_line[0] if tp_line else ""), (train_line[0] if train_line else "")


@pytest.mark.parametrize("sp_on", [True, False])
def test_the_sequence_parallel_rule_decides_build_train_plan_and_checks_alike(
    run_on_ranks, tmp_path: Path, monkeypatch, sp_on: bool
):
    cfg = {**AUTO, "checkpoint": {"resume": "none", "save_at_end": False}}
    build, train = run_on_ranks(4, _build_and_train_under_rule, cfg, str(tmp_path), sp_on)[0]
    assert f"sequence_parallel={sp_on}" in build and f"sequence_parallel={sp_on}" in train

    import forge_tp_plans.checks as tp_checks
    from forge.plan import plan_layout

    monkeypatch.setattr(tp_checks, "default_sequence_parallel", lambda **_: sp_on)
    loaded = load_config(cfg)
    assert resolve_layout(loaded, 4).sequence_parallel is sp_on
    planned = plan_layout(loaded, 4)
    assert planned.ok, planned.broken_rules
    explicit = plan_layout(load_config({**cfg, "tp": {"sequence_parallel": sp_on}}), 4)
    opposite = plan_layout(load_config({**cfg, "tp": {"sequence_parallel": not sp_on}}), 4)
    # forge plan's estimate and collectives are those of the rule's choice, not of the other one
    assert (planned.activation, planned.collectives) == (explicit.activation, explicit.collectives)
    assert planned.collectives != opposite.collectives


def test_the_layout_resolves_degrees_data_mode_and_batches_once():
    layout = resolve_layout(load_config({"parallelism": {"tp": 4}}), 4)
    assert (layout.parallelism.dp_shard, layout.data) == (1, "none")  # no rank left for DP
    layout = resolve_layout(
        load_config({"training": {"global_batch_size": 8, "grad_accum": 2}, "parallelism": {}}), 4
    )
    assert (layout.data, layout.dp_degree, layout.batch_per_rank, layout.micro_batch) == (
        "fsdp2",
        4,
        2,
        1,
    )
    moe = resolve_layout(
        load_config({"model": {"preset": "debug_moe"}, "parallelism": {"ep": -1}}), 4
    )
    assert moe.parallelism.ep == 4  # ep=-1: the largest degree dividing dp_shard and 8 experts
    tied = resolve_layout(
        load_config({"model": {"preset": "debug_tied"}, "parallelism": {"tp": 2}}), 2
    )
    assert (
        tied.sequence_parallel is False and resolve_layout(load_config(AUTO), 4).sequence_parallel
    )


def _resolutions_on_a_rank(cfg: dict, out: str) -> tuple[int, int]:
    """How many times forge build's and forge train's rank code resolve the layout: every
    forge module's name for resolve_layout counts its calls."""
    import sys

    import forge.layout
    from forge.job import run_build
    from forge.train import run_train

    real, calls = forge.layout.resolve_layout, []

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    holders = [
        m
        for n, m in list(sys.modules.items())
        if n.split(".")[0] == "forge" and getattr(m, "resolve_layout", None) is real
    ]
    for module in holders:
        module.resolve_layout = counting
    try:
        run_build(cfg)
        in_build = len(calls)
        run_train({**cfg, "training": {**cfg["training"], "out_dir": out}})
    finally:
        for module in holders:
            module.resolve_layout = real
    return in_build, len(calls) - in_build


def test_a_rank_resolves_the_layout_once_per_job(run_on_ranks, tmp_path: Path):
    """resolve_layout runs once on each rank of forge build and of forge train; the checks,
    the mesh and ParallelPlan get that value (before: 4 times per rank and job)."""
    cfg = {**AUTO, "checkpoint": {"resume": "none", "save_at_end": False}}
    for build, train in run_on_ranks(4, _resolutions_on_a_rank, cfg, str(tmp_path)):
        assert (build, train) == (1, 1)


def test_what_pipeline_stages_cannot_give_is_refused_in_the_tp_layers_words():
    from forge_tp_plans.checks import pipeline_stage_problems

    asked = ["parallelism.tp=2", "tp.sequence_parallel=true", "tp.loss_parallel=true"]
    staged = resolve_layout(load_config(None, ["parallelism.pp=2", *asked]), 4)
    words = pipeline_stage_problems(sequence_parallel=True, loss_parallel=True, pp=2)
    assert staged.refused == tuple(words) and len(words) == 2
    assert resolve_layout(load_config(None, asked), 4).refused == ()
    auto = resolve_layout(load_config(None, ["parallelism.pp=2", "parallelism.tp=2"]), 4)
    assert auto.refused == ()  # "auto" is simply off on the stages


@pytest.mark.parametrize(
    ("overrides", "device_type", "gathers"),
    [
        ([], "cuda", True),  # "auto": tensorwise, FSDP2, no TP, NCCL
        ([], "cpu", False),  # gloo cannot all-gather float8 tensors
        (["parallelism.tp=2"], "cuda", False),  # torchao's fp8 weights do not support TP
        (["float8.recipe=rowwise"], "cuda", False),  # one scale per tensor only
        (["float8.fsdp_float8_all_gather=false"], "cuda", False),
        (["float8.fsdp_float8_all_gather=true"], "cpu", True),  # asked: as asked
        (["float8.enabled=false"], "cuda", False),
    ],
)
def test_the_fp8_all_gather_is_decided_once_by_the_layout(overrides, device_type, gathers):
    cfg = load_config(
        None, ["parallelism.tp=1", "float8.enabled=true", *overrides]
    )  # 4 ranks: dp_shard 4 (or 2 x tp 2)
    layout = resolve_layout(cfg, 4, device_type=device_type)
    assert layout.float8_all_gather is gathers
    assert layout.device_type == device_type
