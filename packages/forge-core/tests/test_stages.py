"""The stage-order contract refuses wrong orders and repeats, naming the right order."""

from __future__ import annotations

import pytest
import torch
from forge_core import (
    ForgeConfigError,
    ModelConfig,
    Transformer,
    applied_stages,
    check_stage,
    record_stage,
)
from forge_core.stages import stage, unwrap


def _meta_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelConfig.preset("debug"))


def test_stages_in_order_are_recorded():
    m = _meta_model()
    for name in ("tp", "ep", "float8", "ac", "compile", "fsdp2"):
        with stage(m, name):
            pass
    assert applied_stages(m) == ["tp", "ep", "float8", "ac", "compile", "fsdp2"]


@pytest.mark.parametrize(
    ("done", "late"),
    [("fsdp2", "ac"), ("ac", "float8"), ("compile", "tp"), ("ddp", "compile"), ("fsdp2", "ddp")],
)
def test_out_of_order_stage_is_refused_with_the_order(done, late):
    m = _meta_model()
    record_stage(m, done)
    with pytest.raises(
        ForgeConfigError,
        match=rf"cannot apply '{late}' after \['{done}'\].*TP -> CP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2",
    ):
        check_stage(m, late)


def test_stages_are_read_through_compile_wrappers():
    m = _meta_model()
    record_stage(m, "ac")
    compiled = torch.compile(m, backend="eager")
    assert unwrap(compiled) is m and applied_stages(compiled) == ["ac"]
