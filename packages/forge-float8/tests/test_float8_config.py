"""forge-float8's ``[float8]`` rules that need neither torch nor torchao."""

from __future__ import annotations

import pytest
from forge_float8.config import Float8Config


@pytest.mark.parametrize(
    ("asked", "recipe", "data", "tp", "backend", "expected"),
    [
        ("auto", "tensorwise", "fsdp2", 1, "nccl", True),  # the one case "auto" turns it on
        ("auto", "tensorwise", "fsdp2", 1, "gloo", False),  # gloo cannot all-gather float8
        ("auto", "tensorwise", "fsdp2", 2, "nccl", False),  # torchao's wrapper: no DTensor
        ("auto", "rowwise", "fsdp2", 1, "nccl", False),  # tensorwise only
        ("auto", "tensorwise", "ddp", 1, "nccl", False),  # FSDP2 only
        ("auto", "tensorwise", "none", 1, None, False),
        (True, "tensorwise", "fsdp2", 1, "gloo", True),  # asked: as asked
        (False, "tensorwise", "fsdp2", 1, "nccl", False),
    ],
)
def test_fsdp_float8_all_gather_is_resolved_in_one_place(
    asked, recipe, data, tp, backend, expected
):
    cfg = Float8Config(enabled=True, recipe=recipe, fsdp_float8_all_gather=asked)
    assert cfg.resolve_fsdp_all_gather(data=data, tp=tp, dp_backend=backend) is expected
