"""What pipeline parallelism cannot run with is refused before any rank starts: one line per
problem, each naming the field and the fix; ``forge build`` / ``forge train`` print them all
and exit 2 (the launcher is patched to fail the test if a rank would start)."""

from __future__ import annotations

import pytest
from forge import cli
from forge.checks import config_problems, import_problems
from forge.config import load_config
from forge.layout import resolve_layout

from tests.integration.pp.jobs import api_refusals

#: pp=2 on the default 4 ranks, without the default tp=2: pp=2 x dp_shard=2.
PP2 = ["parallelism.pp=2", "parallelism.tp=1"]

#: Each override (with PP2) -> the words of the one line it brings.
REFUSED = {
    "tp.sequence_parallel=true": "tp.sequence_parallel=true with parallelism.pp=2",
    "tp.loss_parallel=true": "tp.loss_parallel=true with parallelism.pp=2",
    "parallelism.data=ddp": "data='ddp' with pp=2",
    "model.tie_embeddings=true": "model.tie_embeddings=true with parallelism.pp=2",
    "training.grad_accum=2": "training.grad_accum=2 with parallelism.pp=2",
    "pp.microbatches=3": "pp.microbatches=3 does not divide the 4 samples",
    "model.n_layers=1": "parallelism.pp=2 x pp.stages_per_rank=1 = 2 stages, but the model has 1",
    "pp.split_points=[4]": "pp.split_points=[4] must be 1 increasing block indices",
}


def _problems(overrides: list[str], world_size: int = 4) -> list[str]:
    return config_problems(load_config(None, overrides), world_size)


def _set(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


@pytest.fixture
def no_launch(monkeypatch):
    def launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank was started for a config with problems")

    monkeypatch.setattr(cli, "_launch_local", launch)


def test_a_pipelined_config_that_can_run_has_no_problems():
    for overrides in (
        PP2,
        ["parallelism.pp=2"],  # pp=2 x tp=2: basic TP on each stage
        ["parallelism.pp=4", "parallelism.tp=1", "model.n_layers=4", "pp.schedule=GPipe"],
        [*PP2, "model.preset=debug_moe", "parallelism.ep=2"],
        [*PP2, "model.preset=debug_vlm"],  # the decoder is pipelined, the encoder on stage 0
        [*PP2, "training.compile=true"],  # per-block compile on every stage
        [*PP2, "pp.schedule=Interleaved1F1B", "model.n_layers=4"],
    ):
        cfg = load_config(None, [*overrides, "model.n_layers=4"])
        assert config_problems(cfg, 4) == [], overrides
        assert import_problems(cfg, 4) == [], overrides


@pytest.mark.parametrize(("override", "words"), list(REFUSED.items()), ids=list(REFUSED))
def test_each_problem_is_one_line_naming_the_field(override, words):
    problems = _problems([*PP2, "model.n_layers=4", override])
    assert len(problems) == 1, problems
    assert words in problems[0], problems
    assert "\n" not in problems[0]
    assert _problems([*PP2, "model.n_layers=4"]) == []  # the override alone makes it


def test_whole_model_compile_is_refused_only_with_compile_on():
    scope = [*PP2, "training.compile_scope=model"]
    assert _problems(scope) == []
    problems = _problems([*scope, "training.compile=true"])
    assert len(problems) == 1, problems
    assert problems[0].startswith("training.compile_scope='model' with parallelism.pp=2")
    assert "compile_scope='blocks'" in problems[0]


def test_a_field_model_cannot_be_pipelined():
    problems = _problems(["parallelism.pp=2", "model.preset=debug_field"])
    assert len(problems) == 1, problems
    assert problems[0].startswith("parallelism.pp is set for a field model")


def test_sequence_and_loss_parallel_resolve_off_on_pipeline_stages():
    auto = resolve_layout(load_config(None, ["parallelism.pp=2", "parallelism.tp=2"]), 4)
    assert auto.tp == 2 and not auto.sequence_parallel and not auto.loss_parallel
    asked = ["parallelism.pp=2", "tp.sequence_parallel=true", "tp.loss_parallel=true"]
    layout = resolve_layout(load_config(None, asked), 4)
    assert not layout.sequence_parallel and not layout.loss_parallel
    # without pp the same config keeps both (the pipeline is what turns them off)
    flat = resolve_layout(load_config(None, asked[1:]), 4)
    assert flat.sequence_parallel and flat.loss_parallel


@pytest.mark.parametrize("command", ["build", "train"])
def test_build_and_train_print_every_pipeline_problem_before_any_rank(command, capsys, no_launch):
    overrides = [*PP2, "model.n_layers=4", *REFUSED]
    expected = _problems(overrides)
    assert len(expected) == len(REFUSED)  # independent problems: all of them at once
    assert cli.main([command, *_set(overrides)]) == cli.EXIT_CONFIG
    lines = capsys.readouterr().err.splitlines()
    prefix = f"forge {command}: config error: "
    assert lines == [prefix + p for p in expected], lines
    for words in REFUSED.values():
        assert sum(words in line for line in lines) == 1, words


def test_a_schedule_this_torch_lacks_is_refused_in_the_import_phase(capsys, monkeypatch, no_launch):
    import torch.distributed.pipelining.schedules as schedules

    monkeypatch.delattr(schedules, "ScheduleGPipe")
    overrides = [*PP2, "pp.schedule=gpipe"]
    assert config_problems(load_config(None, overrides), 4) == []  # the values are fine
    assert cli.main(["train", *_set(overrides)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("forge train: config error: pp.schedule='GPipe': torch "), err
    assert "has no ScheduleGPipe" in err and err.count("\n") == 1, err
    # not asked for without a pipeline
    assert import_problems(load_config(None, ["pp.schedule=gpipe"]), 4) == []


def test_the_plan_refuses_the_schedules_stage_counts_in_the_configs_words(run_on_ranks):
    (line,) = _problems([*PP2, "pp.schedule=Interleaved1F1B", "pp.stages_per_rank=1"])
    assert line == (
        "pp.schedule='Interleaved1F1B' interleaves several stages per rank, but "
        "pp.stages_per_rank=1; set stages_per_rank >= 2, or use 1F1B / GPipe"
    )
    for said in run_on_ranks(2, api_refusals, "Interleaved1F1B", 1):
        assert said["plan"] == line


def test_pipeline_split_refuses_a_model_that_holds_values_and_leaves_it_whole(run_on_ranks):
    for said in run_on_ranks(2, api_refusals, "1F1B", 1):
        assert said["plan"] == "made"
        assert said["split"] == (
            "pipeline parallelism cuts a model on the meta device, but this Transformer holds "
            "values (41 parameters or buffers are not on meta; cutting would delete this rank's "
            "other blocks from it); build the model under torch.device('meta') and let "
            "ParallelPlan.parallelize(model, device=..., seed=...) materialize each stage"
        )
        assert said["blocks"] == ["0", "1", "2", "3"]  # nothing was pruned
