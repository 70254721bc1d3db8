"""build_device_mesh: axis layout and rank groups checked against groups computed by hand."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from forge_core import ForgeConfigError, ParallelismConfig, get_dp_mesh, get_tp_mesh, has_dp_mesh
from forge_core.mesh_dims import dp_rank_and_size, sub_mesh
from forge_mesh import build_device_mesh, mesh_layout


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """One rank of a fake-backend world in this process (no communication happens)."""
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _groups(layout: dict, world: int, axes: list[str]) -> dict[int, dict[str, list[int]]]:
    out = {}
    for rank in range(world):
        with fake_world(rank, world):
            mesh = build_device_mesh(layout, "cpu")
            out[rank] = {a: sub_mesh(mesh, a).mesh.flatten().tolist() for a in axes}
    return out


def _expected(
    sizes: dict[str, int], groups: dict[str, tuple[str, ...]]
) -> dict[int, dict[str, list[int]]]:
    """Row-major rank layout over ``sizes``; a group = ranks that differ only along its axes."""
    names = list(sizes)
    coords = list(itertools.product(*(range(sizes[n]) for n in names)))
    out: dict[int, dict[str, list[int]]] = {}
    for rank, c in enumerate(coords):
        out[rank] = {}
        for gname, members in groups.items():
            fixed = [i for i, n in enumerate(names) if n not in members]
            out[rank][gname] = [r for r, d in enumerate(coords) if all(d[i] == c[i] for i in fixed)]
    return out


def test_hsdp_tp_2x2x2_groups():
    got = _groups(
        {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, 8, ["dp_replicate", "dp_shard", "tp", "dp"]
    )
    # by hand for rank 5 = (replicate 1, shard 0, tp 1)
    assert got[5] == {"dp_replicate": [1, 5], "dp_shard": [5, 7], "tp": [4, 5], "dp": [1, 3, 5, 7]}
    assert got == _expected(
        {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
        {
            "dp_replicate": ("dp_replicate",),
            "dp_shard": ("dp_shard",),
            "tp": ("tp",),
            "dp": ("dp_replicate", "dp_shard"),
        },
    )


def test_pp_dp_tp_2x2x2_groups():
    got = _groups({"pp": 2, "tp": 2}, 8, ["pp", "dp_shard", "tp"])
    assert got[6] == {"pp": [2, 6], "dp_shard": [4, 6], "tp": [6, 7]}
    assert got == _expected(
        {"pp": 2, "dp_shard": 2, "tp": 2}, {"pp": ("pp",), "dp_shard": ("dp_shard",), "tp": ("tp",)}
    )


def test_dp_cp_tp_groups_and_fsdp_shard_group():
    got = _groups({"dp_shard": 2, "cp": 2, "tp": 2}, 8, ["dp_shard", "cp", "tp", "dp_shard_cp"])
    assert got == _expected(
        {"dp_shard": 2, "cp": 2, "tp": 2},
        {
            "dp_shard": ("dp_shard",),
            "cp": ("cp",),
            "tp": ("tp",),
            "dp_shard_cp": ("dp_shard", "cp"),
        },
    )


def test_credit_style_layout_with_domain():
    got = _groups({"data": "fsdp2", "tensor": 2, "domain": 2}, 8, ["dp_shard", "domain", "tp"])
    assert got == _expected(
        {"dp_shard": 2, "domain": 2, "tp": 2},
        {"dp_shard": ("dp_shard",), "domain": ("domain",), "tp": ("tp",)},
    )


def test_dp_mesh_helpers():
    with fake_world(0, 8):
        hsdp = build_device_mesh({"dp_replicate": 2, "tp": 2}, "cpu")
        dp = get_dp_mesh(hsdp)
        assert dp.mesh_dim_names == ("dp_replicate", "dp_shard") and dp.shape == (2, 2)
        assert get_tp_mesh(hsdp).size() == 2 and has_dp_mesh(hsdp)
    with fake_world(3, 4):
        fsdp = build_device_mesh(ParallelismConfig(), "cpu")
        assert get_dp_mesh(fsdp).mesh_dim_names == ("dp_shard",) and get_tp_mesh(fsdp) is None
        assert dp_rank_and_size(fsdp) == (3, 4)
    with fake_world(1, 4):
        tp_only = build_device_mesh({"tp": 4, "data": "none"}, "cpu")
        assert not has_dp_mesh(tp_only) and dp_rank_and_size(tp_only) == (0, 1)
        with pytest.raises(ValueError, match=r"no data-parallel axis"):
            get_dp_mesh(tp_only)


def test_single_rank_world_gets_a_size_one_dp_shard_axis():
    with fake_world(0, 1):
        mesh = build_device_mesh({}, "cpu")
        assert mesh.mesh_dim_names == ("dp_shard",) and mesh.size() == 1


def test_thousands_of_ranks_plan_in_one_process():
    with fake_world(1000, 4096):
        mesh = build_device_mesh({"dp_replicate": 4, "tp": 8}, "cpu")
        assert mesh.shape == (4, 128, 8)
        assert sub_mesh(mesh, "dp").size() == 512


def test_fsdp2_replication_keeps_a_size_one_shard_axis():
    assert mesh_layout({"dp_replicate": 4}, 4) == (("dp_replicate", "dp_shard"), (4, 1))
    assert mesh_layout({"dp_replicate": 4, "data": "ddp"}, 4) == (("dp_replicate",), (4,))


def test_mesh_layout_is_pure():
    assert mesh_layout({"tp": 2, "dp_replicate": 2}, 16) == (
        ("dp_replicate", "dp_shard", "tp"),
        (2, 4, 2),
    )


def test_bad_layout_fails_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ForgeConfigError, match=r"world size 6 is not divisible by .*tp=4"):
        build_device_mesh({"tp": 4}, "cpu")
    assert not dist.is_initialized()


def _allreduce_on_axes(layout: dict) -> dict[str, float]:
    mesh = build_device_mesh(layout, "cpu")
    out = {}
    for axis in ("dp_replicate", "dp_shard", "dp"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=sub_mesh(mesh, axis).get_group())
        out[axis] = t.item()
    return out


def test_gloo_groups_reduce_over_the_right_ranks(run_on_ranks):
    results = run_on_ranks(4, _allreduce_on_axes, {"dp_replicate": 2})
    # rank = 2 * replicate + shard
    assert results == [
        {"dp_replicate": 0 + 2, "dp_shard": 0 + 1, "dp": 6},
        {"dp_replicate": 1 + 3, "dp_shard": 0 + 1, "dp": 6},
        {"dp_replicate": 0 + 2, "dp_shard": 2 + 3, "dp": 6},
        {"dp_replicate": 1 + 3, "dp_shard": 2 + 3, "dp": 6},
    ]


def test_ep_is_carved_out_of_dp_shard_with_neighbouring_peers():
    # 8 ranks: dp_replicate 2 x dp_shard 4 (= dp_shard_mod_ep 2 x ep 2); the world size is not
    # multiplied by ep, and ep peers are adjacent ranks.
    layout = {"dp_replicate": 2, "ep": 2}
    got = _groups(layout, 8, ["ep", "dp_shard_mod_ep", "dp_shard", "expert_dp"])
    assert got[5] == {
        "ep": [4, 5],
        "dp_shard_mod_ep": [5, 7],
        "dp_shard": [4, 5, 6, 7],
        "expert_dp": [1, 3, 5, 7],
    }
    assert got == _expected(
        {"dp_replicate": 2, "dp_shard_mod_ep": 2, "ep": 2},
        {
            "ep": ("ep",),
            "dp_shard_mod_ep": ("dp_shard_mod_ep",),
            "dp_shard": ("dp_shard_mod_ep", "ep"),
            "expert_dp": ("dp_replicate", "dp_shard_mod_ep"),
        },
    )


def test_ep_with_tp_keeps_tp_innermost():
    got = _groups({"ep": 2, "tp": 2}, 8, ["ep", "tp", "expert_dp"])
    # rank 6 = (dp_shard_mod_ep 1, ep 1, tp 0)
    assert got[6] == {"ep": [4, 6], "tp": [6, 7], "expert_dp": [2, 6]}


def test_ep_mesh_helpers():
    from forge_core.mesh_dims import get_dp_group_mesh, get_ep_mesh, get_expert_dp_mesh

    with fake_world(1, 4):
        mesh = build_device_mesh({"ep": 4}, "cpu")
        assert mesh.mesh_dim_names == ("dp_shard",)  # the root stays the dense layout
        assert get_ep_mesh(mesh).size() == 4 and get_expert_dp_mesh(mesh).size() == 1
        assert get_dp_group_mesh(mesh).size() == 4
    with fake_world(1, 4):
        dense = build_device_mesh({}, "cpu")
        assert get_ep_mesh(dense) is None
        assert get_expert_dp_mesh(dense).mesh_dim_names == ("dp_shard",)


def test_check_mesh_matches_names_each_axis_that_differs_and_the_fix():
    from forge_core import ForgeConfigError, ParallelismConfig
    from forge_mesh import check_mesh_matches

    check_mesh_matches(ParallelismConfig(dp_shard=1, ep=1), None)  # one device: every axis 1
    with pytest.raises(ForgeConfigError, match=r"tp=2 .* has tp=1: .* set parallelism.tp=1"):
        check_mesh_matches(ParallelismConfig(dp_shard=1, ep=1, tp=2), None)
