"""forge-domain's tests composed with forge-fsdp-wrap: the domain stage sits between Float8 and
AC in the stage order (refused after forge_fsdp_wrap's apply_ac)."""

from __future__ import annotations

import pytest
import torch.nn as nn
from domain_jobs import ConvNet
from forge_core import ForgeConfigError
from forge_core.stages import check_stage
from forge_domain import DomainConv2d
from forge_fsdp_wrap import apply_ac


def test_domain_stage_sits_between_float8_and_ac():
    holder = nn.Sequential(ConvNet())
    holder.layers = nn.ModuleList([holder[0]])  # give AC a block container
    apply_ac(holder, "full")
    with pytest.raises(ForgeConfigError, match="cannot apply 'domain' after \\['ac'\\]"):
        check_stage(holder, "domain")
    assert issubclass(DomainConv2d, nn.Conv2d)
