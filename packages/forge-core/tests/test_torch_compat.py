"""Every function of forge_core.torch_compat works on the installed torch (2.11 through 2.15).

These are the private torch APIs forge relies on; when a torch release moves one, the test of
that function fails here by name.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core import torch_compat as tc


def _meshes() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    split = tc.unflatten_mesh_dim(mesh, "dp_shard", (2, 2), ("dp_mod_ep", "ep"))
    ep, outer = split["ep"], split["dp_mod_ep"]
    flat = tc.flatten_mesh(split[("dp_mod_ep", "ep")], "both")
    return {
        "names": split.mesh_dim_names,
        "ep_ranks": dist.get_process_group_ranks(ep.get_group()),
        "outer_ranks": dist.get_process_group_ranks(outer.get_group()),
        "flat_size": flat.size(),
        "flat_ranks": dist.get_process_group_ranks(flat.get_group()),
        "ep_groups": tc.mesh_group_ranks(ep).tolist(),
    }


def test_mesh_unflatten_flatten_and_group_ranks(run_on_ranks):
    results = run_on_ranks(4, _meshes)
    assert results[0]["names"] == ("dp_mod_ep", "ep")
    assert [r["ep_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["outer_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["flat_size"] == 4 and r["flat_ranks"] == [0, 1, 2, 3] for r in results)
    assert results[0]["ep_groups"] == [0, 1, 2, 3]  # group {0, 1}, then group {2, 3}


def _fsdp_groups() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {
        "inner": [len(g.fsdp_params) for g in tc.fsdp_param_groups(model[0])],
        "root": [len(g.fsdp_params) for g in tc.fsdp_param_groups(model)],
        "auto": tc.fsdp_reshards_root_after_forward(model),
    }


def test_fsdp_param_groups_and_root_reshard_flag(run_on_ranks):
    out = run_on_ranks(4, _fsdp_groups)[0]
    assert out["inner"] == [2] and out["root"] == [2]  # weight and bias of each Linear
    assert isinstance(out["auto"], bool)


class _Probe(torch.autograd.Function):
    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen.append(tc.in_backward_pass())
        return grad * 2


def test_in_backward_pass_is_true_only_inside_backward():
    _Probe.seen.clear()
    x = torch.ones(3, requires_grad=True)
    assert not tc.in_backward_pass()
    _Probe.apply(x).sum().backward()
    assert _Probe.seen == [True] and not tc.in_backward_pass()


def test_assert_on_device_passes_true_and_raises_on_false():
    tc.assert_on_device(torch.tensor(True), "never shown")
    with pytest.raises(RuntimeError, match="the message"):
        tc.assert_on_device(torch.tensor(False), "the message")


def test_checkpoint_wrapper_is_recognized_and_inductor_cache_dir_is_a_path():
    wrapped = tc.checkpoint_wrapper(nn.Linear(2, 2))
    assert tc.is_checkpoint_wrapper(wrapped) and not tc.is_checkpoint_wrapper(nn.Linear(2, 2))
    x = torch.ones(1, 2, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None
    assert os.path.isabs(tc.inductor_cache_dir())


def test_torch_dispatch_mode_sees_aten_ops():
    seen: list[str] = []

    class Log(tc.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Log():
        torch.ones(2) + 1
    assert "aten.add" in seen


def test_compiled_modules_are_recognized_and_unwrapped():
    plain = nn.Linear(2, 2)
    wrapped = torch.compile(plain, backend="eager")
    assert tc.compiled_original(wrapped) is plain and tc.is_compiled(wrapped)
    in_place = nn.Linear(2, 2)
    in_place.compile(backend="eager")
    assert tc.compiled_original(in_place) is None and tc.is_compiled(in_place)
    assert tc.compiled_original(plain) is None and not tc.is_compiled(nn.Linear(2, 2))


def test_non_persistent_buffer_names():
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("dropped", torch.zeros(1), persistent=False)
    assert tc.non_persistent_buffer_names(module) == {"dropped"}


def _local_shapes() -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    shapes = [tc.local_shape_and_offset(torch.Size((5, 4)), mesh, [Shard(0)])]
    shapes.append(tc.local_shape_and_offset(torch.Size((5, 4)), mesh, [Replicate()]))
    return shapes


def test_local_shape_and_offset_of_a_shard(run_on_ranks):
    rank0, rank1 = run_on_ranks(2, _local_shapes)
    assert rank0 == [((3, 4), (0, 0)), ((5, 4), (0, 0))]
    assert rank1 == [((2, 4), (3, 0)), ((5, 4), (0, 0))]


def test_strided_shard_type_and_overload_name():
    from torch.distributed.tensor import Shard

    strided = tc.strided_shard_type()
    assert strided.__name__ == "_StridedShard" and strided(0, split_factor=2).dim == 0
    assert not isinstance(Shard(0), strided)
    assert tc.overload_name(torch.ops.aten.add.Tensor) == "Tensor"
    assert tc.overload_name(torch.ops.aten.repeat_interleave.self_int) == "self_int"


def test_dcp_metadata_path(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    path = tc.dcp_metadata_path(FileSystemReader(tmp_path))
    assert str(path).endswith(".metadata") and str(tmp_path) in str(path)


def test_dcp_index_globals_are_what_a_real_index_names(tmp_path):
    """The private globals a DCP index pickles are the ones listed (a torch that renames one
    fails here, not in a user's resume)."""
    import pickletools

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save({"w": torch.ones(2, 3)}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    named = {
        tuple(arg.split(" ", 1))
        for op, arg, _ in pickletools.genops(data)
        if op.name == "GLOBAL" and isinstance(arg, str)
    }
    strings = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    named |= {  # protocol 4 spells a global as two strings then STACK_GLOBAL
        (strings[i], strings[i + 1])
        for i in range(len(strings) - 1)
        if strings[i].startswith("torch.distributed.checkpoint.") and strings[i + 1].startswith("_")
    }
    listed = tc.dcp_index_globals()
    private_named = {g for g in named if g[1].startswith("_")}
    assert private_named <= set(listed), private_named - set(listed)
    assert ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in listed
    assert all(
        callable(v) or isinstance(v, type) or hasattr(v, "__members__") for v in listed.values()
    )


def test_swap_parameter_puts_a_tensor_where_forward_reads_the_parameter():
    lin = nn.Linear(2, 2, bias=False)
    param = lin.weight
    doubled = param * 2
    assert tc.swap_parameter(lin, "weight", doubled) is param
    assert lin.weight is doubled and torch.equal(lin(torch.eye(2)), (param * 2).T)
    assert tc.swap_parameter(lin, "weight", param) is doubled and lin.weight is param


def test_scaled_mm_multiplies_fp8_with_per_tensor_scales():
    a = torch.full((16, 16), 2.0).to(torch.float8_e4m3fn)
    b = torch.full((16, 16), 0.5).to(torch.float8_e4m3fn).t()
    out = tc.scaled_mm(a, b, torch.tensor(3.0), torch.tensor(2.0), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.float(), torch.full((16, 16), 16 * 2.0 * 0.5 * 3.0 * 2.0))
