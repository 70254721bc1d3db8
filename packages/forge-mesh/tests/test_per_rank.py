"""forge_mesh.per_rank: every rank's bytes from rank 0's DTensors, against torch.chunk by hand."""

from __future__ import annotations

import torch
import torch.nn as nn
from forge_mesh.per_rank import per_rank_bytes
from test_mesh import fake_world
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def _module(**params: torch.Tensor) -> nn.Module:
    module = nn.Module()
    for name, value in params.items():
        module.register_parameter(name, nn.Parameter(value))
    return module


def test_shards_chunk_like_torch_chunk_on_every_rank():
    with fake_world(0, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        full = torch.empty(5, 7, device="meta")
        model = _module(
            rows_cols=distribute_tensor(full, mesh, [Shard(0), Shard(1)]),
            rows_only=distribute_tensor(full, mesh, [Shard(0), Replicate()]),
            plain=torch.empty(3, device="meta"),
        )
        model.plain.requires_grad_(False)
        out = per_rank_bytes([model], 4)
    # rank = 2 * dp + tp; rows chunk 5 -> 3, 2 over dp; columns 7 -> 4, 3 over tp (fp32: 4 bytes)
    rows, cols = [3, 3, 2, 2], [4, 3, 4, 3]
    sharded = [r * c for r, c in zip(rows, cols, strict=True)]
    params = [4 * (s + r * 7 + 3) for s, r in zip(sharded, rows, strict=True)]
    assert out["params"].tolist() == params
    assert out["grads"].tolist() == [p - 4 * 3 for p in params]  # the frozen one has none
    assert out["optim"].tolist() == [2 * (p - 4 * 3) for p in params]  # AdamW: 2 fp32 states
    assert out["padded"].tolist() == params  # no FSDP2 here: nothing padded


def test_a_rank_past_the_last_chunk_holds_nothing():
    with fake_world(0, 4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        model = _module(w=distribute_tensor(torch.empty(2, 3, device="meta"), mesh, [Shard(0)]))
        assert per_rank_bytes([model, model], 4)["params"].tolist() == [12, 12, 0, 0]
