"""Expert parallelism in models built by forge's build_parallel_model on CPU ranks: FSDP2 units of
MoE blocks, the experts' own axis, no process group held by the MoE layers (the EP layer's
mechanics alone: packages/forge-moe-ep/tests/test_ep_layer.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from forge.build import build_parallel_model
from forge_mesh import build_device_mesh
from forge_moe_ep import MoE
from forge_moe_ep.config import MoEModelConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule


def _fsdp_units() -> dict[str, object]:
    cfg = MoEModelConfig.preset("debug_moe")
    mesh = build_device_mesh({"dp_shard": 4, "ep": 2}, "cpu", num_experts=cfg.num_experts)
    model = build_parallel_model(cfg, "cpu", mesh, param_dtype=torch.float32)
    units = {n: m for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    experts = model.layers["0"].feed_forward.experts
    w1 = experts.w1
    return {
        "units": sorted(n for n in units if n),
        "expert_mesh": w1.device_mesh.mesh_dim_names,
        "expert_local_shape": tuple(w1.to_local().shape),
        # The MoE holds no group: the ep group is the ep axis of its experts' weights' mesh.
        "ep_group": sorted(dist.get_process_group_ranks(w1.device_mesh.get_group("ep"))),
    }


def test_fsdp2_wraps_moe_blocks_per_sub_module_and_shards_experts_on_their_own_axis(run_on_ranks):
    got = run_on_ranks(4, _fsdp_units)
    for rank, info in enumerate(got):
        assert info["units"] == [
            "layers.0",
            "layers.0.attention",
            "layers.0.feed_forward",
            "layers.0.feed_forward.experts",
            "layers.1",
            "layers.1.attention",
            "layers.1.feed_forward",
            "layers.1.feed_forward.experts",
        ]
        # experts [8, 64, 64]: 4 per ep rank, then halved by FSDP2 over dp_shard_mod_ep
        assert info["expert_mesh"] == ("dp_shard_mod_ep", "ep")
        assert info["expert_local_shape"] == (2, 64, 64)
        assert info["ep_group"] == ([0, 1] if rank < 2 else [2, 3])


def _groups_held_by_moe_layers() -> list[str]:
    cfg = MoEModelConfig.preset("debug_moe")
    mesh = build_device_mesh({"dp_shard": 2, "ep": 2}, "cpu", num_experts=cfg.num_experts)
    model = build_parallel_model(cfg, "cpu", mesh, param_dtype=torch.float32)
    found = []
    for name, moe in model.named_modules():
        if isinstance(moe, MoE):
            for attr, value in vars(moe).items():
                if isinstance(value, (dist.ProcessGroup, DeviceMesh)):
                    found.append(f"{name}.{attr}")
    return found


def test_moe_layers_hold_no_process_group_or_mesh_under_ep(run_on_ranks):
    # EP is applied from outside (hooks on the experts and router, a load hook): the layer
    # itself keeps no ProcessGroup or DeviceMesh attribute.
    assert run_on_ranks(2, _groups_held_by_moe_layers) == [[], []]
