"""The host-sync guard flags every op that would sync a GPU, passes sync-free code, and cleans up.

The CPU tests pass ``"cpu"`` explicitly: with a GPU present the default device is CUDA, where the
guards use torch's sync debug mode instead (tested at the bottom).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from forge_core.testing.sync_guard import (
    SYNC_OPS,
    HostSyncCounter,
    HostSyncError,
    count_host_syncs,
    no_host_sync,
)

ORIGINAL_TOLIST = torch.Tensor.tolist
ORIGINAL_NUMPY = torch.Tensor.numpy


def _x() -> torch.Tensor:
    return torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, -2.5])


def _set_mask(value: torch.Tensor) -> None:
    x = _x()
    x[x > 0] = value


# (id, op name expected in the error, the code that syncs)
SYNCING: list[tuple[str, str, Callable[[], object]]] = [
    ("item", "_local_scalar_dense", lambda: _x()[0].item()),
    ("int", "_local_scalar_dense", lambda: int(_x()[0])),
    ("float", "_local_scalar_dense", lambda: float(_x()[0])),
    ("bool", "_local_scalar_dense", lambda: bool(_x()[0])),
    ("if_tensor", "_local_scalar_dense", lambda: 1 if _x().sum() > 0 else 0),
    ("tolist", "Tensor.tolist", lambda: _x().tolist()),
    ("numpy", "Tensor.numpy", lambda: _x().numpy()),
    ("equal", "aten.equal", lambda: torch.equal(_x(), _x())),
    ("allclose", "aten.allclose", lambda: torch.allclose(_x(), _x())),
    ("nonzero", "aten.nonzero", lambda: _x().nonzero()),
    ("argwhere", "aten.nonzero", lambda: torch.argwhere(_x())),
    ("where_one_arg", "aten.nonzero", lambda: torch.where(_x() > 0)),
    ("unique", "aten._unique2", lambda: torch.unique(_x())),
    ("unique_dim", "aten.unique_dim", lambda: torch.unique(_x().view(2, 3), dim=0)),
    ("unique_consecutive", "aten.unique_consecutive", lambda: torch.unique_consecutive(_x())),
    ("masked_select", "aten.masked_select", lambda: _x().masked_select(_x() > 0)),
    ("bincount", "aten.bincount", lambda: torch.bincount(torch.tensor([0, 2, 2]), minlength=4)),
    ("bool_mask_getitem", "aten.index", lambda: _x()[_x() > 0]),
    ("bool_mask_setitem_tensor", "aten.index_put_", lambda: _set_mask(torch.tensor(1.0))),
    (
        "index_put_bool",
        "aten.index_put",
        lambda: _x().index_put((_x() > 0,), torch.tensor(1.0)),
    ),
    (
        "repeat_interleave_no_output_size",
        "aten.repeat_interleave",
        lambda: _x().repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1])),
    ),
]


def _linear_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    loss = torch.nn.functional.cross_entropy(
        model(torch.randn(5, 4)), torch.tensor([0, 1, 2, 0, 1])
    )
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def _scatter_add() -> torch.Tensor:
    return torch.zeros(4).scatter_add_(0, torch.tensor([0, 2, 2]), torch.ones(3))


SYNC_FREE: list[tuple[str, Callable[[], object]]] = [
    ("topk", lambda: _x().topk(2)),
    ("sort", lambda: _x().sort()),
    ("argsort", lambda: _x().argsort()),
    ("scatter_add_", _scatter_add),
    ("index_select", lambda: _x().index_select(0, torch.tensor([0, 2]))),
    ("gather", lambda: _x().gather(0, torch.tensor([1, 0]))),
    ("cumsum", lambda: _x().cumsum(0)),
    ("searchsorted", lambda: torch.searchsorted(torch.tensor([0.0, 1.0, 2.0]), _x())),
    (
        "repeat_interleave_output_size",
        lambda: _x().repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1]), output_size=6),
    ),
    ("repeat_interleave_int", lambda: _x().repeat_interleave(2)),
    ("integer_index", lambda: _x()[torch.tensor([0, 3])]),
    ("where_three_args", lambda: torch.where(_x() > 0, _x(), 0.0)),
    ("bool_mask_setitem_scalar", lambda: _set_mask(0.0)),  # Python lowers it to masked_fill_
    ("masked_fill", lambda: _x().masked_fill(_x() > 0, torch.tensor(1.0))),
    ("nonzero_static", lambda: torch.nonzero_static(_x(), size=3)),
    ("matmul", lambda: torch.randn(3, 4) @ torch.randn(4, 2)),
    ("softmax", lambda: _x().softmax(0)),
    ("linear_forward_backward_step", _linear_step),
]


def _planted_item(t: torch.Tensor) -> float:
    return t.sum().item()


def test_no_host_sync_catches_planted_item() -> None:
    with no_host_sync("cpu"), pytest.raises(HostSyncError) as info:
        _planted_item(_x())
    message = str(info.value)
    assert "aten._local_scalar_dense" in message and "t.item()" in message
    assert "keep the value on the device" in message
    assert "_planted_item" in message and "test_sync_guard.py" in message  # the call site


@pytest.mark.parametrize(("op", "fn"), [(c[1], c[2]) for c in SYNCING], ids=[c[0] for c in SYNCING])
def test_no_host_sync_raises_on_every_flagged_op(op: str, fn: Callable[[], object]) -> None:
    with no_host_sync("cpu"), pytest.raises(HostSyncError, match=op):
        fn()


@pytest.mark.parametrize("fn", [c[1] for c in SYNC_FREE], ids=[c[0] for c in SYNC_FREE])
def test_no_host_sync_passes_sync_free_ops(fn: Callable[[], object]) -> None:
    with no_host_sync("cpu"):
        fn()


def test_index_put_of_a_just_lifted_scalar_is_the_masked_fill_path() -> None:
    """torch <= 2.14 runs ``x[mask] = 0.0`` as lift_fresh + index_put_, which ATen turns into
    masked_fill_ (no sync); a value tensor made on the device, or accumulation, still syncs."""
    x = _x()
    mask = x > 0
    with no_host_sync("cpu"):
        x.index_put_((mask,), torch.tensor(0.0))  # lifted just before: the host scalar
    for value, accumulate in ((x.new_zeros(()), False), (torch.tensor(1.0), True)):
        with no_host_sync("cpu"), pytest.raises(HostSyncError, match="index_put_"):
            x.index_put_((mask,), value, accumulate=accumulate)


def test_error_messages_say_what_to_do_instead() -> None:
    cases = {
        "repeat_interleave_no_output_size": "output_size",
        "nonzero": "nonzero_static",
        "bool_mask_getitem": "torch.where",
    }
    for name, advice in cases.items():
        fn = next(c[2] for c in SYNCING if c[0] == name)
        with no_host_sync("cpu"), pytest.raises(HostSyncError, match=advice):
            fn()


def test_every_flagged_op_has_a_unique_name_and_advice() -> None:
    names = [op.name for op in SYNC_OPS]
    assert len(names) == len(set(names))
    assert all(op.spelling and op.instead for op in SYNC_OPS)


class _SyncInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        scale = grad.abs().max().item()  # the planted sync
        return grad * 2 / max(scale, 1.0)


def test_no_host_sync_catches_sync_in_backward() -> None:
    x = torch.randn(3, requires_grad=True)
    with no_host_sync("cpu"):
        loss = _SyncInBackward.apply(x).sum()  # forward is sync-free
        with pytest.raises(HostSyncError, match="_local_scalar_dense"):
            loss.backward()


def _assert_restored() -> None:
    assert torch.Tensor.tolist is ORIGINAL_TOLIST and torch.Tensor.numpy is ORIGINAL_NUMPY
    assert "tolist" not in torch.Tensor.__dict__ and "numpy" not in torch.Tensor.__dict__
    t = torch.tensor([1.0, 2.0])
    assert t.sum().item() == 3.0 and t.tolist() == [1.0, 2.0] and t.numpy().sum() == 3.0
    assert torch.nonzero(t).shape == (2, 1)


def test_no_host_sync_restores_after_normal_exit() -> None:
    with no_host_sync("cpu"):
        assert torch.Tensor.tolist is not ORIGINAL_TOLIST
    _assert_restored()


def test_no_host_sync_restores_after_exception() -> None:
    with pytest.raises(ValueError, match="boom"), no_host_sync("cpu"):
        raise ValueError("boom")
    with pytest.raises(HostSyncError), no_host_sync("cpu"):
        _x().tolist()
    _assert_restored()


def test_count_host_syncs_counts_items_and_tolist() -> None:
    t = _x()
    with count_host_syncs("cpu") as counter:
        for i in range(3):
            t[i].item()
        values = t.tolist()
    assert values == t.tolist()  # the patched tolist still returns the data
    assert isinstance(counter, HostSyncCounter)
    assert counter.count == 4
    assert counter.ops == {"aten._local_scalar_dense": 3, "Tensor.tolist": 1}
    _assert_restored()


def test_count_host_syncs_counts_zero_for_sync_free_block() -> None:
    with count_host_syncs("cpu") as counter:
        _linear_step()
        _scatter_add()
    assert counter.count == 0 and not counter.ops


def test_count_host_syncs_restores_after_exception() -> None:
    with pytest.raises(ValueError, match="boom"), count_host_syncs("cpu") as counter:
        _x().tolist()
        raise ValueError("boom")
    assert counter.count == 1
    _assert_restored()


def test_counter_inside_no_host_sync_counts_then_outer_guard_raises() -> None:
    with no_host_sync("cpu"):
        with pytest.raises(HostSyncError), count_host_syncs("cpu") as counter:
            _x()[0].item()
        with pytest.raises(HostSyncError), count_host_syncs("cpu") as counter_2:
            _x().tolist()
        with count_host_syncs("cpu") as quiet:
            _x().softmax(0)
    assert counter.ops == {"aten._local_scalar_dense": 1}
    assert counter_2.ops == {"Tensor.tolist": 1}
    assert quiet.count == 0
    _assert_restored()


def test_nested_counters_both_count() -> None:
    with count_host_syncs("cpu") as outer:
        _x().tolist()
        with count_host_syncs("cpu") as inner:
            _x()[0].item()
            _x().numpy()
    assert (outer.count, inner.count) == (3, 2)
    _assert_restored()


class _Subclass(torch.Tensor):
    """Inherits torch.Tensor.__torch_function__, which calls the patched method a second time."""


def test_tensor_subclass_host_copy_counts_once() -> None:
    t = _x().as_subclass(_Subclass)
    with count_host_syncs("cpu") as counter:
        t.tolist()
        t.numpy()
        t[0].item()
    assert counter.ops == {"Tensor.tolist": 1, "Tensor.numpy": 1, "aten._local_scalar_dense": 1}


def test_host_copy_patch_ignores_other_threads_and_survives_out_of_order_exit() -> None:
    entered, release = threading.Event(), threading.Event()
    other: dict[str, int] = {}

    def worker() -> None:
        with count_host_syncs("cpu") as counter:
            entered.set()
            release.wait(timeout=5)
            _x().tolist()
        other["count"] = counter.count

    thread = threading.Thread(target=worker)
    with count_host_syncs("cpu") as mine:
        thread.start()
        entered.wait(timeout=5)  # the worker's guard wraps ours
        _x().tolist()  # the worker's wrapper must not count the main thread's call
    release.set()  # the worker exits after us: out of order
    thread.join(timeout=5)
    assert mine.count == 1 and other == {"count": 1}
    _assert_restored()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is CUDA here")
def test_default_device_without_a_gpu_is_op_detection() -> None:
    with no_host_sync(), pytest.raises(HostSyncError):
        _x().tolist()
    with count_host_syncs() as counter:
        _x()[0].item()
    assert counter.count == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_no_host_sync_on_cuda_sets_and_restores_sync_debug_mode() -> None:
    before = torch.cuda.get_sync_debug_mode()
    t = torch.ones(3, device="cuda")
    with no_host_sync("cuda"):
        assert torch.cuda.get_sync_debug_mode() == 2  # "error"
        with pytest.raises(RuntimeError, match="synchronizing"):
            t.sum().item()
    assert torch.cuda.get_sync_debug_mode() == before
    with pytest.raises(ValueError), no_host_sync("cuda"):
        raise ValueError
    assert torch.cuda.get_sync_debug_mode() == before
    assert t.sum().item() == 3.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_count_host_syncs_on_cuda_counts_warnings() -> None:
    t = torch.ones(3, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    with count_host_syncs("cuda") as quiet:
        _ = (t * 2).softmax(0)
    with count_host_syncs("cuda") as counter:
        t.sum().item()
        t.tolist()
    assert quiet.count == 0
    assert counter.count >= 2  # each D2H read warns at least once
    assert torch.cuda.get_sync_debug_mode() == before


def test_compiled_functions_run_eagerly_and_are_checked_inside_the_guard():
    @torch.compile(backend="eager", fullgraph=True)
    def leaky(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.ones(3)
    leaky(x)  # compiled outside the guard
    with count_host_syncs("cpu") as counter:
        leaky(x).sum().item()
    assert counter.count == 1
    with no_host_sync("cpu"):
        assert leaky(x).shape == (3,)
