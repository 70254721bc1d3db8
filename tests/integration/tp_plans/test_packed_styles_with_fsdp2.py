"""forge-tp-plans' fused-Linear ("packed") and MLA style tests composed with forge-fsdp-wrap: under
FSDP2 x TP on 4 CPU gloo ranks, a packed Phi3 and an MLA MiniCPM3 match the unsharded model in
logits and every gradient (TP=2 alone: packages/forge-tp-plans/tests/test_packed_styles.py, whose models and
check these reuse)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from forge_fsdp_wrap import apply_fsdp2, default_mp_policy
from test_packed_styles import _hf_parity as _tp_parity
from torch.distributed.device_mesh import DeviceMesh

#: What this module's rank functions import inside the function: the rank workers' forkserver
#: imports it once (forge_core.testing.pytest_ranks).
RANK_PRELOAD = ["transformers"]

# NOTE: the Hugging Face lane (marker zoo, with tests/zoo), not the README suite (its time).
pytestmark = pytest.mark.zoo


def _fsdp2(model: nn.Module, mesh: DeviceMesh) -> None:
    apply_fsdp2(model, mesh, default_mp_policy(torch.float32))


def _hf_parity(name: str, layout: dict, explicit: bool) -> dict:
    """packages/forge-tp-plans/tests/test_packed_styles.py's check, with FSDP2 applied after TP."""
    return _tp_parity(name, layout, explicit, shard=_fsdp2)


@pytest.mark.parametrize(("name", "explicit"), [("phi3", False), ("minicpm3", True)])
def test_fsdp2_x_tp_packed_and_mla_logits_and_grads_match(run_on_ranks, name, explicit):
    out = run_on_ranks(4, _hf_parity, name, {"tp": 2}, explicit)[0]
    assert out["styles"]
