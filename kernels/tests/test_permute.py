"""Routing layout, permute / unpermute / combine and rank-major reorder: Triton vs PyTorch vs loops.

On a machine without CUDA the Triton kernels run on CPU tensors through the Triton interpreter
(``TRITON_INTERPRET=1``, set below before the kernels are first imported); with CUDA they run
compiled on the GPU. Shapes stay tiny: each interpreted launch costs milliseconds.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    # NOTE: triton decides interpreter mode when a kernel is decorated, i.e. at the first import
    # of forge_kernels.permute._triton; permute.py imports it lazily, after this line.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from forge_kernels.permute import (  # noqa: E402
    RoutingLayout,
    backend_used,
    combine,
    permute,
    rank_major_to_expert_major,
    rank_major_to_expert_major_reference,
    routing_capacity,
    routing_layout,
    routing_layout_reference,
    unpermute,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["triton", "torch"]


# --------------------------------------------------------------------------- loop references
def naive_layout(expert_ids: torch.Tensor, num_experts: int, align: int) -> RoutingLayout:
    """The contract, spelled out with Python loops."""
    t, k = expert_ids.shape
    n, flat = t * k, expert_ids.reshape(-1).tolist()
    counts = [flat.count(e) for e in range(num_experts)]
    padded = [-(-c // align) * align for c in counts]
    offs = list(itertools.accumulate(padded))
    capacity = n if align == 1 else n + num_experts * (align - 1)
    gather, scatter = [n] * capacity, [0] * n
    for e in range(num_experts):
        row = offs[e] - padded[e]
        for s in range(n):
            if flat[s] == e:
                gather[row], scatter[s] = s, row
                row += 1

    def as_tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=expert_ids.device)

    return RoutingLayout(
        as_tensor(counts, torch.int32),
        as_tensor(offs, torch.int32),
        as_tensor(gather, torch.int64),
        as_tensor(scatter, torch.int64),
    )


def naive_rank_major_to_expert_major(counts_re: torch.Tensor, capacity: int):
    c = counts_re.tolist()
    r_count, e_count = len(c), len(c[0])
    starts, pos = {}, 0
    for r in range(r_count):
        for e in range(e_count):
            starts[r, e], pos = pos, pos + c[r][e]
    index, offs = [], []
    for e in range(e_count):
        for r in range(r_count):
            index += [starts[r, e] + j for j in range(c[r][e])]
        offs.append(len(index))
    index = (index + [capacity] * capacity)[:capacity]
    dev = counts_re.device
    return torch.tensor(index, dtype=torch.int64, device=dev), torch.tensor(
        offs, dtype=torch.int32, device=dev
    )


def assert_layouts_equal(a: RoutingLayout, b: RoutingLayout) -> None:
    for name, x, y in zip(RoutingLayout._fields, a, b, strict=True):
        assert x.dtype == y.dtype, (name, x.dtype, y.dtype)
        assert torch.equal(x, y), (name, x, y)


# (T, K, E, align, kind): kind shapes the routing.
ROUTINGS = [
    (13, 2, 5, 1, "random"),
    (50, 3, 7, 8, "random"),  # 150 slots: several 64-slot blocks
    (40, 4, 6, 16, "random"),
    (24, 2, 9, 8, "empty_experts"),  # experts 0, 2, 4, ... get nothing
    (30, 2, 4, 16, "one_expert"),  # everything to expert 3
    (1, 4, 8, 8, "random"),  # T = 1
    (33, 1, 3, 1, "random"),  # K = 1
    (17, 3, 5, 3, "random"),  # align not a power of two
    (1, 1, 1, 32, "random"),
    (0, 2, 3, 8, "random"),  # no tokens at all
]


def make_ids(t: int, k: int, e: int, kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "empty_experts":
        ids = torch.randint(0, (e + 1) // 2, (t, k), generator=g) * 2 + 1
        ids = ids.clamp(max=e - 1)
    elif kind == "one_expert":
        ids = torch.full((t, k), e - 1)
    else:
        ids = torch.randint(0, e, (t, k), generator=g)
    return ids.to(dtype=dtype, device=DEVICE)


# --------------------------------------------------------------------------- routing layout
@pytest.mark.parametrize("t,k,e,align,kind", ROUTINGS)
def test_routing_layout_triton_torch_and_loop_reference_are_identical(t, k, e, align, kind):
    for i, dtype in enumerate([torch.int64, torch.int32]):
        ids = make_ids(t, k, e, kind, dtype, seed=i)
        expected = naive_layout(ids, e, align)
        assert expected.gather_idx.numel() == routing_capacity(t, k, e, align)
        assert_layouts_equal(routing_layout_reference(ids, e, align), expected)
        assert_layouts_equal(routing_layout(ids, e, align, backend="triton"), expected)
        assert_layouts_equal(routing_layout(ids, e, align), expected)  # default backend


def test_routing_layout_rows_follow_stable_argsort_within_padded_groups():
    ids = make_ids(60, 2, 6, "random", torch.int64)
    layout = routing_layout(ids, 6, 8, backend="triton")
    real = layout.gather_idx[layout.gather_idx < ids.numel()]
    assert torch.equal(real, torch.argsort(ids.flatten(), stable=True))
    starts = layout.offs - (layout.counts + 7) // 8 * 8
    assert bool((starts % 8 == 0).all()) and bool((layout.offs % 8 == 0).all())
    assert torch.equal(
        layout.gather_idx[layout.scatter_idx], torch.arange(ids.numel(), device=DEVICE)
    )


def test_routing_layout_rejects_bad_arguments_with_actionable_errors():
    ids = make_ids(4, 2, 3, "random", torch.int64)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        routing_layout(ids.flatten(), 3)
    with pytest.raises(ValueError, match="int32 or int64"):
        routing_layout(ids.float(), 3)
    with pytest.raises(ValueError, match="align must be >= 1"):
        routing_layout(ids, 3, align=0)
    with pytest.raises(ValueError, match="num_experts"):
        routing_layout(ids, 0)
    with pytest.raises(ValueError, match="backend="):
        routing_layout(ids, 3, backend="cuda")


def test_backend_used_reports_the_path_taken():
    assert backend_used("cpu") == "torch"
    assert backend_used(torch.zeros(1), "torch") == "torch"
    assert backend_used(DEVICE, "triton") == "triton"
    if torch.cuda.is_available():
        assert backend_used("cuda") == "triton"


# --------------------------------------------------------------------------- permute / unpermute
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t,k,e,align", [(21, 3, 5, 8), (9, 1, 4, 1), (1, 2, 3, 16)])
def test_permute_places_token_rows_and_zero_padding_and_unpermute_inverts_it(
    backend, t, k, e, align
):
    ids = make_ids(t, k, e, "random", torch.int64)
    layout = routing_layout(ids, e, align, backend=backend)
    x = torch.randn(t, 10, device=DEVICE)
    x_perm = permute(x, layout, k, backend=backend)
    expected = torch.zeros(layout.gather_idx.numel(), 10, device=DEVICE)
    for r, s in enumerate(layout.gather_idx.tolist()):
        if s < t * k:
            expected[r] = x[s // k]
    assert torch.equal(x_perm, expected)  # padding rows are exact zeros
    y_slots = unpermute(x_perm, layout, backend=backend)
    assert torch.equal(y_slots, x.repeat_interleave(k, dim=0))  # each slot gets its token's row


def test_permute_unpermute_copy_bf16_rows_bit_exactly():
    ids = make_ids(12, 2, 4, "random", torch.int64)
    x = torch.randn(12, 24, device=DEVICE).to(torch.bfloat16)
    for backend in BACKENDS:
        layout = routing_layout(ids, 4, 16, backend=backend)
        y = unpermute(permute(x, layout, 2, backend=backend), layout, backend=backend)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, x.repeat_interleave(2, dim=0))


# --------------------------------------------------------------------------- combine
@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_with_uniform_weights_of_permuted_x_returns_x(backend):
    t, k, e = 19, 4, 6
    layout = routing_layout(make_ids(t, k, e, "random", torch.int64), e, 8, backend=backend)
    x = torch.randn(t, 12, device=DEVICE)
    w = torch.full((t, k), 1.0 / k, device=DEVICE)
    out = combine(permute(x, layout, k, backend=backend), layout, w, backend=backend)
    torch.testing.assert_close(out, x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_matches_loop_weighted_sum_and_never_reads_padding_rows(backend):
    t, k, e, d = 15, 3, 5, 9
    ids = make_ids(t, k, e, "empty_experts", torch.int64)
    layout = routing_layout(ids, e, 16, backend=backend)
    y_perm = torch.randn(layout.gather_idx.numel(), d, device=DEVICE)
    y_perm[layout.gather_idx == t * k] = float("nan")  # like grouped_mm's uninitialized rows
    w = torch.rand(t, k, device=DEVICE)
    expected = torch.zeros(t, d, device=DEVICE)
    scatter = layout.scatter_idx.tolist()
    for tok, j in itertools.product(range(t), range(k)):
        expected[tok] += w[tok, j] * y_perm[scatter[tok * k + j]]
    out = combine(y_perm, layout, w, backend=backend)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_slots_read_as_zero_and_get_no_gradient(backend):
    # A capacity-limited layout: slots whose row is >= the number of rows are dropped.
    t, k, d = 6, 2, 5
    layout = routing_layout(make_ids(t, k, 3, "random", torch.int64), 3, 1, backend=backend)
    cap = 7  # keep only the first 7 rows of the expert-major order
    scatter = layout.scatter_idx.clone()
    scatter[scatter >= cap] = cap
    gather = layout.gather_idx[:cap].clone()
    capped = RoutingLayout(layout.counts, layout.offs.clamp(max=cap), gather, scatter)
    y = torch.randn(cap, d, device=DEVICE, requires_grad=True)
    w = torch.rand(t, k, device=DEVICE, requires_grad=True)
    out = combine(y, capped, w, backend=backend)
    kept = (scatter < cap).view(t, k)
    y_pad = torch.cat([y, torch.zeros(1, d, device=DEVICE)])
    expected = (y_pad[scatter].view(t, k, d) * w.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    assert torch.all(w.grad[~kept] == 0) and torch.all(w.grad[kept] != 0)
    slots = unpermute(y.detach(), capped, backend=backend)
    assert torch.all(slots[scatter == cap] == 0)
    torch.testing.assert_close(slots[scatter < cap], y.detach()[scatter[scatter < cap]])


def test_combine_triton_matches_torch_in_bf16_with_fp32_weights():
    t, k, e, d = 10, 2, 3, 16
    layout = routing_layout(make_ids(t, k, e, "random", torch.int64), e, 8)
    y_perm = torch.randn(layout.gather_idx.numel(), d, device=DEVICE).to(torch.bfloat16)
    w = torch.rand(t, k, device=DEVICE)
    out_triton = combine(y_perm, layout, w, backend="triton")
    out_torch = combine(y_perm, layout, w, backend="torch")
    assert out_triton.dtype == out_torch.dtype == torch.bfloat16
    # Same fp32 sum, one rounding to bf16: identical on a GPU. The Triton interpreter (CPU)
    # truncates fp32 -> bf16 instead of rounding to nearest: allow that one bf16 ulp there.
    tol = 0.0 if DEVICE.type == "cuda" else 2.0**-7
    torch.testing.assert_close(out_triton, out_torch, rtol=tol, atol=tol * 1e-3)


# --------------------------------------------------------------------------- gradients
def _moe_like_loss(x, w, scale, ids, e, align, backend):
    """permute -> per-expert row scaling -> combine, with the layout of ``ids``."""
    t, k = ids.shape
    layout = routing_layout(ids, e, align, backend=backend)
    rows = torch.arange(layout.gather_idx.numel(), device=DEVICE)
    expert_of_row = torch.searchsorted(layout.offs.long(), rows, right=True).clamp(max=e - 1)
    y_perm = permute(x, layout, k, backend=backend) * scale[expert_of_row]
    out = combine(y_perm, layout, w, backend=backend)
    return (out * torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out)).sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_combine_gradients_match_autograd_of_pure_torch_formulation(backend):
    t, k, e, d, align = 14, 3, 5, 8, 8
    ids = make_ids(t, k, e, "empty_experts", torch.int64)
    x = torch.randn(t, d, device=DEVICE, requires_grad=True)
    w = torch.rand(t, k, device=DEVICE, requires_grad=True)
    scale = torch.randn(e, d, device=DEVICE, requires_grad=True)
    loss = _moe_like_loss(x, w, scale, ids, e, align, backend)
    grads = torch.autograd.grad(loss, (x, w, scale))

    xr, wr, sr = (v.detach().clone().requires_grad_() for v in (x, w, scale))
    # Pure torch: out[t] = sum_k w[t, k] * x[t] * scale[ids[t, k]], no layout at all.
    out = (wr.unsqueeze(-1) * xr.unsqueeze(1) * sr[ids]).sum(1)
    loss_ref = (out * torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out)).sum()
    grads_ref = torch.autograd.grad(loss_ref, (xr, wr, sr))
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpermute_gradient_reaches_real_rows_and_zeroes_padding(backend):
    t, k, e = 9, 2, 4
    layout = routing_layout(make_ids(t, k, e, "random", torch.int64), e, 8, backend=backend)
    y_perm = torch.randn(layout.gather_idx.numel(), 5, device=DEVICE, requires_grad=True)
    g = torch.randn(t * k, 5, device=DEVICE)
    (grad,) = torch.autograd.grad((unpermute(y_perm, layout, backend=backend) * g).sum(), y_perm)
    padded_g = torch.cat([g, g.new_zeros(1, 5)])
    assert torch.equal(grad, padded_g[layout.gather_idx])


@pytest.mark.parametrize(
    "backend,align,dense", [("triton", 2, False), ("torch", 2, False), ("torch", 1, True)]
)
def test_autograd_functions_pass_gradcheck_in_float64(backend, align, dense):
    t, k, e = 4, 2, 3
    layout = routing_layout(make_ids(t, k, e, "random", torch.int64), e, align, backend=backend)
    x = torch.randn(t, 3, device=DEVICE, dtype=torch.float64, requires_grad=True)
    y = torch.randn(layout.gather_idx.numel(), 3, device=DEVICE, dtype=torch.float64)
    y.requires_grad_()
    w = torch.rand(t, k, device=DEVICE, dtype=torch.float64, requires_grad=True)
    opts = dict(backend=backend, dense=dense)
    assert torch.autograd.gradcheck(lambda x: permute(x, layout, k, **opts), (x,))
    assert torch.autograd.gradcheck(lambda y: unpermute(y, layout, **opts), (y,))
    assert torch.autograd.gradcheck(lambda y, w: combine(y, layout, w, **opts), (y, w))


class _OpNames(TorchDispatchMode):
    """Records the aten op packets that run (forward and backward) inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_dense_promise_gives_the_same_numbers_without_masking_passes():
    """The lean path: on a layout that is a permutation of the slots (align 1, ids in range),
    dense=True returns bit-identical values and gradients and runs no masking op at all."""
    t, k, e, d = 13, 3, 5, 4
    layout = routing_layout(make_ids(t, k, e, "random", torch.int64), e, 1, backend="torch")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(t, d, generator=g), torch.rand(t, k, generator=g)
    g_out, g_slots = torch.randn(t, d, generator=g), torch.randn(t * k, d, generator=g)
    x, w, g_out, g_slots = (v.to(DEVICE) for v in (x, w, g_out, g_slots))  # the layout's device

    def run(dense: bool):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        with _OpNames() as ops:
            y_perm = permute(xg, layout, k, backend="torch", dense=dense) * 1.5
            out = combine(y_perm, layout, wg, backend="torch", dense=dense)
            slots = unpermute(y_perm, layout, backend="torch", dense=dense)
            torch.autograd.backward([out, slots], [g_out, g_slots])
        return [out, slots, xg.grad, wg.grad], ops.names

    masked, masked_ops = run(False)
    lean, lean_ops = run(True)
    for a, b in zip(masked, lean, strict=True):
        assert torch.equal(a, b)
    masking = {"aten.masked_fill_", "aten.masked_fill", "aten.where", "aten.clamp"}
    assert masking & masked_ops  # the general path does mask: this check can fail
    assert not masking & lean_ops, masking & lean_ops


# --------------------------------------------------------------------------- grouped GEMM
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm not available")
@pytest.mark.parametrize("align", [1, 8])
def test_layout_offs_drive_grouped_mm_to_per_token_expert_matmuls(align):
    t, k, e, d, n = 16, 2, 4, 16, 8
    ids = make_ids(t, k, e, "empty_experts", torch.int64)
    layout = routing_layout(ids, e, align)
    x = torch.randn(t, d, device=DEVICE)
    weight = torch.randn(e, d, n, device=DEVICE)
    w = torch.rand(t, k, device=DEVICE)
    y_perm = torch._grouped_mm(permute(x, layout, k), weight, offs=layout.offs)
    out = combine(y_perm, layout, w)
    expected = (w.unsqueeze(-1) * torch.einsum("td,tkdn->tkn", x, weight[ids])).sum(1)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- rank -> expert major
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "r,e,extra,zeros",
    [(3, 4, 0, False), (4, 2, 9, True), (1, 5, 3, False), (5, 1, 0, True), (2, 3, 4, "all")],
)
def test_rank_major_to_expert_major_matches_loop_reference(backend, r, e, extra, zeros):
    g = torch.Generator().manual_seed(r * 10 + e)
    counts = torch.randint(0, 6, (r, e), generator=g, dtype=torch.int32)
    if zeros is True:
        counts[torch.rand(r, e, generator=g) < 0.4] = 0
    elif zeros == "all":
        counts.zero_()
    counts = counts.to(DEVICE)
    capacity = int(counts.sum()) + extra
    index, offs = rank_major_to_expert_major(counts, capacity, backend=backend)
    exp_index, exp_offs = naive_rank_major_to_expert_major(counts, capacity)
    assert index.dtype == torch.int64 and offs.dtype == torch.int32
    assert torch.equal(index, exp_index) and torch.equal(offs, exp_offs)


def test_rank_major_to_expert_major_reorders_received_rows_into_expert_groups():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]], dtype=torch.int32, device=DEVICE)
    received = torch.tensor([0, 0, 2, 0, 1, 1, 1], device=DEVICE)  # expert of each received row
    index, offs = rank_major_to_expert_major(counts, 9)
    # A receive buffer of capacity rows (7 used) plus the row the sentinel index 9 points at.
    by_expert = torch.cat([received, received.new_full((3,), -1)])[index]
    assert by_expert.tolist() == [0, 0, 0, 1, 1, 1, 2, -1, -1]
    assert offs.tolist() == [3, 6, 7]
    assert torch.equal(index, rank_major_to_expert_major_reference(counts, 9)[0])


# --------------------------------------------------------------------------- no host sync
@contextlib.contextmanager
def _host_reads_raise():
    """Make every way Python code can read a tensor value on the host raise.

    CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: on CPU there is no sync to
    detect, so this checks the structure instead: no ``.item()``, ``.tolist()``, ``bool()``,
    ``int()``, ``float()``, ``.numpy()``, ``.cpu()`` / cross-device ``.to()``, and no
    data-dependent-shape op (``nonzero``, ``unique``, ``masked_select``, ``bincount``).
    """

    def refuse(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host read during a sync-free call: {name}")

        return raise_

    original_to = torch.Tensor.to

    def to_same_device(self, *args, **kwargs):
        out = original_to(self, *args, **kwargs)
        if out.device != self.device:
            raise AssertionError(f"host read during a sync-free call: .to({out.device})")
        return out

    patches = [(torch.Tensor, "to", to_same_device)]
    for name in [
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "numpy",
        "cpu",
        "nonzero",
        "unique",
        "masked_select",
    ]:
        patches.append((torch.Tensor, name, refuse(f"Tensor.{name}")))
    for name in ["nonzero", "unique", "masked_select", "bincount"]:
        patches.append((torch, name, refuse(f"torch.{name}")))
    # NOTE: MonkeyPatch deletes on exit what a class only inherited (a plain setattr of the
    # saved value would leave e.g. Tensor.tolist in torch.Tensor.__dict__ for later tests).
    with pytest.MonkeyPatch.context() as mp:
        for owner, name, fn in patches:
            mp.setattr(owner, name, fn)
        yield


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_reads_in_layout_permute_combine_backward_and_rank_reorder(backend):
    t, k, e = 11, 2, 5
    ids = make_ids(t, k, e, "random", torch.int64)
    x = torch.randn(t, 6, device=DEVICE, requires_grad=True)
    w = torch.rand(t, k, device=DEVICE, requires_grad=True)
    counts = torch.randint(0, 4, (3, 2), dtype=torch.int32, device=DEVICE)
    with _host_reads_raise():
        layout = routing_layout(ids, e, 8, backend=backend)
        y_perm = permute(x, layout, k, backend=backend) * 2.0
        out = combine(y_perm, layout, w, backend=backend)
        out.sum().backward(retain_graph=True)
        unpermute(y_perm, layout, backend=backend).sum().backward()
        rank_major_to_expert_major(counts, 32, backend=backend)
    with pytest.raises(AssertionError, match="host read"), _host_reads_raise():
        ids.sum().item()  # the guard itself works


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sync debug mode needs a GPU")
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_cuda_sync_under_sync_debug_mode_error(backend):
    t, k, e = 64, 4, 8
    ids = make_ids(t, k, e, "random", torch.int64)
    x = torch.randn(t, 32, device=DEVICE, requires_grad=True)
    w = torch.rand(t, k, device=DEVICE, requires_grad=True)
    counts = torch.randint(0, 4, (4, 2), dtype=torch.int32, device=DEVICE)

    def step():
        layout = routing_layout(ids, e, 16, backend=backend)
        out = combine(permute(x, layout, k, backend=backend), layout, w, backend=backend)
        out.sum().backward()
        rank_major_to_expert_major(counts, 64, backend=backend)

    step()  # warm up: the first launches compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------- GPU compile check
_SM90_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from forge_kernels.permute import _triton as K
from forge_kernels.permute import _routing_triton as R

def compile_sm90(fn, types, constexprs):
    sig = {n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32))

i32, i64 = "i32", "i64"
compile_sm90(R._hist_kernel, dict(ids_ptr="*i64", hist_ptr="*i32", N=i32, E=i32), dict(BLOCK_S=64))
compile_sm90(R._block_scan_kernel, dict(hist_ptr="*i32", counts_ptr="*i32", NB=i32, E=i32),
             dict(BLOCK_B=32, BLOCK_E=128))
compile_sm90(R._expert_scan_kernel, dict(counts_ptr="*i32", offs_ptr="*i32", starts_ptr="*i32",
             E=i32, align=i32), dict(BLOCK_E=128))
compile_sm90(R._index_kernel, dict(ids_ptr="*i32", prefix_ptr="*i32", starts_ptr="*i32",
             scatter_ptr="*i64", gather_ptr="*i64", N=i32, E=i32, capacity=i32), dict(BLOCK_S=64))
for dt in ["bf16", "fp64"]:
    fp64 = dt == "fp64"
    compile_sm90(K._gather_rows_kernel, dict(src_ptr="*" + dt, idx_ptr="*i64", scale_ptr="*fp32",
                 out_ptr="*" + dt, n_rows=i32, D=i32, div=i32, n_valid=i32, stride_src=i32,
                 stride_out=i32), dict(HAS_SCALE=True, ACC_FP64=fp64, BLOCK_R=4, BLOCK_D=512))
    compile_sm90(K._combine_kernel, dict(y_ptr="*" + dt, scatter_ptr="*i64", w_ptr="*fp32",
                 out_ptr="*" + dt, T=i32, D=i32, K=i32, n_rows=i32, stride_y=i32, stride_out=i32),
                 dict(HAS_W=True, ACC_FP64=fp64, BLOCK_T=4, BLOCK_D=512))
    compile_sm90(K._slot_row_dot_kernel, dict(g_ptr="*" + dt, y_ptr="*" + dt, scatter_ptr="*i64",
                 out_ptr="*fp32", N=i32, D=i32, K=i32, n_rows=i32, stride_g=i32, stride_y=i32),
                 dict(ACC_FP64=fp64, BLOCK_S=8, BLOCK_D=256))
compile_sm90(K._rm_scan_kernel, dict(counts_ptr="*i32", in_start_ptr="*i32", out_end_ptr="*i32",
             offs_ptr="*i32", R=i32, E=i32), dict(BLOCK=1024))
compile_sm90(K._rm_index_kernel, dict(counts_ptr="*i32", in_start_ptr="*i32", out_end_ptr="*i32",
             index_ptr="*i64", R=i32, E=i32, capacity=i32), dict(NSTEPS=6, BLOCK=256))
print("compiled")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests above run the real kernels")
def test_triton_kernels_compile_to_sm90_cubin_without_a_gpu():
    """The interpreter does not type-check like the compiler: build every kernel for H100 here."""
    import subprocess
    import sys

    nvidia = pytest.importorskip("triton.backends.nvidia")
    del nvidia
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
