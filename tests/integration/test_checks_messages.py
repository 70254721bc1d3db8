"""The pre-launch checks return every broken rule: ``forge plan`` lists them all, and ``forge
build`` / ``forge train`` refuse with all of them (one line each, exit 2) before any rank starts.
The raising ``check_*`` forms say the first of the same messages."""

from __future__ import annotations

import sys

import pytest
from forge import cli
from forge.checks import check_config_values, config_problems, import_problems
from forge.config import load_config
from forge_core.errors import ForgeConfigError, refuse
from forge_vlm.checks import check_vlm, vlm_problems

#: Three independent problems on the default 4 ranks (dp_shard 2 x tp 2).
BROKEN = [
    "float8.enabled=true",
    "float8.fsdp_float8_all_gather=true",  # with tp=2: refused
    "training.global_batch_size=7",  # not divisible by the 2 data-parallel ranks
    "training.seq_len=256",  # the debug model's max_seq_len is 128
]
EXPECTED = [
    "float8.fsdp_float8_all_gather=true with tp > 1",
    "training.global_batch_size=7 must be divisible by the 2 data-parallel ranks",
    "training.seq_len=256 exceeds model.max_seq_len=128",
]


def _set(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _matches(lines: list[str]) -> None:
    assert len(lines) == len(EXPECTED), lines
    for line, expected in zip(lines, EXPECTED, strict=True):
        assert expected in line, (line, expected)


def test_config_problems_lists_every_independent_problem():
    problems = config_problems(load_config(None, BROKEN), 4)
    _matches(problems)
    assert all("\n" not in p for p in problems)


def test_a_clean_config_has_no_problems():
    assert config_problems(load_config(None, []), 4) == []
    assert import_problems(load_config(None, []), 4) == []


def test_a_layout_that_does_not_resolve_is_the_only_problem():
    problems = config_problems(load_config(None, ["parallelism.tp=3", *BROKEN]), 4)
    assert len(problems) == 1 and "world size 4 is not divisible by" in problems[0], problems


def test_the_raising_forms_say_the_first_message():
    cfg = load_config(None, BROKEN)
    with pytest.raises(ForgeConfigError) as err:
        check_config_values(cfg, 4)
    assert str(err.value) == config_problems(cfg, 4)[0]
    refuse([])  # nothing to refuse: returns
    with pytest.raises(ForgeConfigError, match="^first$"):
        refuse(["first", "second"])


@pytest.mark.parametrize(
    ("overrides", "count"),
    [
        (["adapter.pool=3"], 1),
        (["adapter.out_dim=32", "training.seq_len=8"], 2),
        (["vlm.image_token_id=999", "vlm.encoder_tp=true", "vision.n_heads=1"], 2),
        (["vlm.encoder_tp=true", "vision.mlp_dim=127"], 1),
    ],
)
def test_vlm_problems_agree_with_check_vlm(overrides, count):
    """vlm_problems finds each independent problem; check_vlm raises the first of them."""
    cfg = load_config(None, ["model.preset=debug_vlm", *overrides])
    assert cfg.vision is not None and cfg.adapter is not None and cfg.vlm is not None
    args = (cfg.decoder, cfg.vision, cfg.adapter, cfg.vlm)
    problems = vlm_problems(*args, seq_len=cfg.training.seq_len, tp=2)
    assert len(problems) == count, problems
    with pytest.raises(ForgeConfigError) as err:
        check_vlm(*args, seq_len=cfg.training.seq_len, tp=2)
    assert str(err.value) == problems[0]


def test_forge_plan_prints_every_broken_rule(capsys):
    assert cli.main(["plan", "--world-size", "4", *_set(BROKEN)]) == 2
    out = capsys.readouterr().out
    _matches([line for line in out.splitlines() if line.startswith("BROKEN: ")])


@pytest.mark.parametrize("command", ["build", "train"])
def test_build_and_train_refuse_with_every_problem_before_any_rank(command, capsys, monkeypatch):
    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank was started for a config with problems")

    monkeypatch.setattr(cli, "_launch_local", no_launch)
    assert cli.main([command, *_set(BROKEN)]) == cli.EXIT_CONFIG
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith(f"forge {command}: config error: ") for line in lines), lines
    _matches(lines)


def test_import_problems_come_once_the_values_are_clean(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_launch_local", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert cli.main(["build", *_set(BROKEN)]) == 2  # the value problems, not torchao
    assert "needs torchao" not in capsys.readouterr().err
    assert cli.main(["build", "--set", "float8.enabled=true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forge build: config error: float8.enabled=true needs torchao"), err
    assert err.count("\n") == 1
