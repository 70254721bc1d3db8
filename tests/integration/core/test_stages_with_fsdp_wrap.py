"""forge-core's stage-order contract composed with forge-fsdp-wrap: the stages apply_ac and
apply_compile record are checked by it (repeats, wrong orders, failed stages, a checkpoint wrapper
applied by hand)."""

from __future__ import annotations

import pytest
import torch
from forge_core import ForgeConfigError, ModelConfig, Transformer, applied_stages, check_stage
from forge_fsdp_wrap import apply_ac, apply_compile
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def _meta_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelConfig.preset("debug"))


def test_repeated_and_unknown_stages_are_refused():
    m = _meta_model()
    apply_ac(m, "full")
    with pytest.raises(ForgeConfigError, match=r"stage 'ac' was already applied"):
        apply_ac(m, "full")
    with pytest.raises(ForgeConfigError, match=r"unknown stage 'fsdp'"):
        check_stage(m, "fsdp")


def test_compile_then_ac_is_refused():
    m = _meta_model()
    apply_compile(m, backend="eager")
    with pytest.raises(ForgeConfigError, match=r"cannot apply 'ac' after \['compile'\]"):
        apply_ac(m, "full")


def test_failed_stage_is_not_recorded():
    m = _meta_model()
    with pytest.raises(ForgeConfigError, match=r"ac_mode='fulll' is invalid.*did you mean 'full'"):
        apply_ac(m, "fulll")
    assert applied_stages(m) == []


def test_checkpoint_wrapper_applied_by_hand_is_detected():
    m = _meta_model()
    m.layers["0"] = checkpoint_wrapper(m.layers["0"])
    assert applied_stages(m) == ["ac"]
    with pytest.raises(ForgeConfigError, match="already applied"):
        apply_ac(m, "full")
