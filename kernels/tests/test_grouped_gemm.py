"""Tests for forge_kernels.grouped_gemm: Triton kernels (interpreter on CPU), the CPU
torch._grouped_mm path, the dispatcher, and the no-host-sync property.

TRITON_INTERPRET is set at the very top, before triton is imported. triton decides compiled vs
interpreted when ``@triton.jit`` decorates a function (triton 3.9 reads the variable through
``triton.knobs`` at that moment; a launch does not re-read it), and its own ``@jit`` library
(``tl.sum``, ``tl.cdiv``, ...) is decorated at ``import triton``. forge's kernels use only
builtins, so their mode depends on their own module alone: ``forge_kernels.grouped_gemm``
imports it lazily, and the ``kern`` fixture reloads it if another test module imported it first
without the variable (proved in a fresh process by
``test_triton_module_reload_recovers_interpreter_mode``). torch is imported first only
to ask whether there is a GPU (``import torch`` does not import triton). On a machine with a GPU
the variable is left alone so the GPU-only tests exercise the compiled, autotuned kernels.
"""

import os

import torch

_ON_GPU = torch.cuda.is_available()
if not _ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import forge_kernels.grouped_gemm as gg  # noqa: E402
import pytest  # noqa: E402
from forge_kernels.grouped_gemm import grouped_gemm, grouped_gemm_backend  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (M, K, N, offs): empty groups, all empty, offs[-1] < M, odd M, K/N not multiples of 32 or 16.
CASES = [
    pytest.param(37, 40, 24, [5, 5, 20, 37], id="ragged-empty-middle"),
    pytest.param(45, 48, 40, [0, 7, 7, 30, 39], id="empty-first-tail-past-offs"),
    pytest.param(13, 24, 16, [0, 0, 0], id="all-groups-empty"),
    pytest.param(64, 48, 48, [64], id="one-group-full"),
    pytest.param(33, 5, 3, [4, 4, 29, 29], id="tiny-unaligned-k-n-empty-last"),
    pytest.param(51, 33, 47, [3, 17, 18, 50, 50], id="odd-everything"),
]


@pytest.fixture(scope="module")
def kern():
    """The Triton module, built for the interpreter on CPU-only machines."""
    mod = importlib.import_module("forge_kernels.grouped_gemm._triton")
    if not _ON_GPU and not mod.INTERPRETED:
        mod = importlib.reload(mod)  # imported earlier without TRITON_INTERPRET
    assert mod.INTERPRETED != _ON_GPU  # interpreted exactly when there is no GPU
    return mod


def _device() -> str:
    return "cuda" if _ON_GPU else "cpu"


def _inputs(m, k, n, offs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(offs)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(e, k, n, generator=g) / k**0.5).to(dtype)
    dout = torch.randn(m, n, generator=g).to(dtype)
    dev = _device()
    offs_t = torch.tensor(offs, dtype=torch.int32, device=dev)
    return x.to(dev), w.to(dev), offs_t, dout.to(dev)


def _reference(x, w, offs, dout):
    """float64 per-group loop: out, dX, dW (rows past offs[-1]: zero output and dX)."""
    x64, w64, d64 = x.double().cpu(), w.double().cpu(), dout.double().cpu()
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    dx = torch.zeros_like(x64)
    dw = torch.zeros_like(w64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x64[start:end] @ w64[e]
        dx[start:end] = d64[start:end] @ w64[e].T
        dw[e] = x64[start:end].T @ d64[start:end]
        start = end
    return out, dx, dw


def _assert_close(got, ref, dtype, what):
    got = got.detach().double().cpu()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    ref_norm = ref.norm().item()
    err = (got - ref).norm().item()
    if ref_norm == 0:
        assert err == 0, f"{what}: expected exact zeros, |err|={err}"
    else:
        assert err / ref_norm <= TOL[dtype], f"{what}: rel err {err / ref_norm:.2e} ({dtype})"


def _check_zeros_past_offs(t, offs, what):
    end = int(offs[-1])
    assert (t.detach()[end:] == 0).all(), f"{what}: rows past offs[-1]={end} are not zero"


@pytest.fixture
def poison_empty(monkeypatch):
    """torch.empty returns NaN-filled floating tensors while active: every output buffer a
    launcher allocates starts poisoned, so an element the kernels fail to write shows up."""
    orig = torch.empty

    def poisoned(*args, **kwargs):
        t = orig(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


def _run_autograd(x, w, offs, dout, backend):
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    out = grouped_gemm(xg, wg, offs, backend=backend)
    out.backward(dout)
    return out, xg.grad, wg.grad


# ---------------------------------------------------------------------------------------------
# Triton path (interpreter on CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n,offs", CASES)
def test_triton_fwd_dx_dw_match_float64_reference_with_poisoned_buffers(
    kern, poison_empty, m, k, n, offs, dtype
):
    x, w, offs_t, dout = _inputs(m, k, n, offs, dtype)
    out, dx, dw = _run_autograd(x, w, offs_t, dout, "triton")
    ref_out, ref_dx, ref_dw = _reference(x, w, offs_t, dout)
    assert out.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert out.shape == (m, n) and dx.shape == (m, k) and dw.shape == (len(offs), k, n)
    _assert_close(out, ref_out, dtype, "out")
    _assert_close(dx, ref_dx, dtype, "dX")
    _assert_close(dw, ref_dw, dtype, "dW")
    _check_zeros_past_offs(out, offs_t, "out")
    _check_zeros_past_offs(dx, offs_t, "dX")
    start = 0
    for e, end in enumerate(offs):
        if end == start:
            assert (dw[e] == 0).all(), f"dW of empty group {e} is not zero"
        start = end


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(block_m=16, block_n=16, block_k=16), id="16-multi-k-iterations"),
        pytest.param(dict(block_m=64, block_n=64, block_k=64), id="64-single-tile"),
        pytest.param(dict(block_m=16, block_n=32, block_k=16, group_m=2), id="swizzle-2"),
        pytest.param(dict(block_m=16, block_n=16, block_k=32, persistent=True), id="persistent"),
    ],
)
def test_triton_launchers_write_every_element_for_each_config(kern, config):
    _check_launchers(kern, kern.GemmConfig(**config), 51, 33, 47, [3, 17, 18, 40, 40], seed=1)


def _check_launchers(kern, cfg, m, k, n, offs, seed):
    """fwd, dX and (not persistent) dW with ``cfg`` into NaN-poisoned outputs, against float64;
    rows past offs[-1] zero; returns dW (or None)."""
    x, w, offs_t, dout = _inputs(m, k, n, offs, torch.float32, seed=seed)
    ref_out, ref_dx, ref_dw = _reference(x, w, offs_t, dout)

    def poisoned(*shape: int) -> torch.Tensor:
        return torch.full(shape, float("nan"), device=x.device)

    out = kern.gmm_rows(x, w, offs_t, out=poisoned(m, n), config=cfg)
    dx = kern.gmm_rows(dout, w.transpose(1, 2), offs_t, out=poisoned(m, k), config=cfg)
    _assert_close(out, ref_out, torch.float32, "out")
    _assert_close(dx, ref_dx, torch.float32, "dX")
    _check_zeros_past_offs(out, offs_t, "out")
    if cfg.persistent:
        return None
    dw = kern.gmm_ragged_k(x, dout, offs_t, out=poisoned(len(offs), k, n), config=cfg)
    _assert_close(dw, ref_dw, torch.float32, "dW")
    return dw


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(block_m=16, block_n=16, block_k=16, tma=True), id="tma"),
        pytest.param(dict(block_m=16, block_n=32, block_k=16, tma=True, group_m=2), id="tma-wide"),
        pytest.param(
            dict(block_m=16, block_n=16, block_k=32, tma=True, persistent=True),
            id="tma-persistent",
        ),
    ],
)
def test_triton_tma_loads_match_the_reference_and_never_cross_a_group(kern, config):
    # Groups of 3, 34 (two whole 16-row tiles and a tail of 2), 1, 22 and 0 rows, 4 rows past
    # offs[-1]: row tiles of `a` read into the next group, which the stores must not show, and
    # dW's whole tiles go through descriptors while each tail is masked.
    dw = _check_launchers(kern, kern.GemmConfig(**config), 64, 32, 48, [3, 37, 38, 60, 60], 4)
    if dw is not None:
        assert (dw[4] == 0).all(), "dW of the empty last group is not zero"


def test_triton_tma_config_refuses_operands_tma_cannot_address(kern):
    x, w, offs_t, _ = _inputs(20, 33, 8, [5, 20], torch.float32)  # K = 33: 132-byte rows
    assert not kern.tma_eligible(x)
    cfg = kern.GemmConfig(16, 16, 16, tma=True)
    with pytest.raises(ValueError, match="tma=False"):
        kern.gmm_rows(x, w, offs_t, config=cfg)
    assert not any(c.tma for c in kern.candidates("rows", fp32=False, tma=False))
    assert not any(c.tma for c in kern.candidates("ragged_k", fp32=True, tma=True))
    assert all(c.tma for c in kern.candidates("rows", fp32=False, tma=True))
    assert any(c.tma for c in kern.candidates("ragged_k", fp32=False, tma=True))


def test_triton_handles_strided_inputs_and_int64_offs(kern):
    m, k, n, offs = 29, 20, 24, [6, 6, 25]
    x, w, offs_t, dout = _inputs(m, k, n, offs, torch.float32, seed=2)
    x_strided = torch.zeros(k + 3, m, device=x.device).t()[:, :k]  # [M, K], strides (1, M)
    x_strided.copy_(x)
    w_strided = w.transpose(1, 2).contiguous().transpose(1, 2)  # [E, K, N], N-major
    out, dx, dw = _run_autograd(x_strided, w_strided, offs_t.long(), dout, "triton")
    ref_out, ref_dx, ref_dw = _reference(x, w, offs_t, dout)
    _assert_close(out, ref_out, torch.float32, "out")
    _assert_close(dx, ref_dx, torch.float32, "dX")
    _assert_close(dw, ref_dw, torch.float32, "dW")


def test_triton_zero_rows_and_zero_k(kern):
    dev = _device()
    x = torch.zeros(0, 8, device=dev)
    w = torch.randn(2, 8, 16, device=dev)
    offs = torch.zeros(2, dtype=torch.int32, device=dev)
    assert grouped_gemm(x, w, offs, backend="triton").shape == (0, 16)
    x = torch.zeros(7, 0, device=dev)
    w = torch.zeros(2, 0, 16, device=dev)
    offs = torch.tensor([3, 5], dtype=torch.int32, device=dev)
    out = grouped_gemm(x, w, offs, backend="triton")
    assert out.shape == (7, 16) and (out == 0).all()


@pytest.mark.skipif(_ON_GPU, reason="interpreter recovery is a CPU-only concern")
def test_triton_module_reload_recovers_interpreter_mode():
    code = textwrap.dedent(
        """
        import importlib, os
        import torch
        import forge_kernels.grouped_gemm._triton as kern  # compiled mode: no TRITON_INTERPRET
        assert not kern.INTERPRETED
        os.environ["TRITON_INTERPRET"] = "1"
        kern = importlib.reload(kern)
        assert kern.INTERPRETED
        from forge_kernels.interpreter import interpreter_index_fix
        x, w = torch.ones(5, 4), torch.ones(2, 4, 3)
        with interpreter_index_fix():
            out = kern.gmm_rows(x, w, torch.tensor([2, 4], dtype=torch.int32))
        assert out[:4].eq(4).all() and out[4:].eq(0).all(), out
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# CPU torch._grouped_mm path
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def nan_tail_grouped_mm(monkeypatch):
    """torch._grouped_mm whose rows past offs[-1] are NaN (as uninitialized memory may be), to
    prove the dispatcher masks them rather than relying on luck."""
    orig = torch._grouped_mm

    def wrapped(a, b, offs=None, **kwargs):
        out = orig(a, b, offs=offs, **kwargs)
        if a.dim() == 2 and b.dim() == 3:
            out[int(offs[-1]) :] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", wrapped)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("m,k,n,offs", CASES)
# NOTE: 16-bit dtypes take the CPU column-major operand layouts (_CPU_COLUMN_MAJOR_FWD / _DX),
# with their own row, K and N padding.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_grouped_mm_path_matches_reference_and_zeroes_rows_past_offs(
    nan_tail_grouped_mm, m, k, n, offs, dtype
):
    x, w, offs_t, dout = _inputs(m, k, n, offs, dtype)
    x, w, offs_t, dout = x.cpu(), w.cpu(), offs_t.cpu(), dout.cpu()
    out, dx, dw = _run_autograd(x, w, offs_t, dout, "torch_grouped_mm")
    ref_out, ref_dx, ref_dw = _reference(x, w, offs_t, dout)
    assert out.dtype == dx.dtype == dw.dtype == dtype
    _assert_close(out, ref_out, dtype, "out")
    _assert_close(dx, ref_dx, dtype, "dX")
    _assert_close(dw, ref_dw, dtype, "dW")
    _check_zeros_past_offs(out, offs_t, "out")
    _check_zeros_past_offs(dx, offs_t, "dX")
    assert dw.shape == w.shape and dx.shape == x.shape


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_torch_grouped_mm_path_copies_unaligned_strides_and_accepts_stride0_grad():
    m, k, n, offs = 21, 12, 8, [4, 15, 19]
    x, w, offs_t, _ = _inputs(m, k, n, offs, torch.float32, seed=3)
    x, w, offs_t = x.cpu(), w.cpu(), offs_t.cpu()
    x_unaligned = torch.zeros(m, k + 1)[:, 1:]  # row stride 13 floats, data 4 bytes off
    x_unaligned.copy_(x)
    xg = x_unaligned.requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    out = grouped_gemm(xg, wg, offs_t, backend="torch_grouped_mm")
    out.sum().backward()  # the incoming gradient is an expanded (stride-0) tensor
    ref_out, ref_dx, ref_dw = _reference(x, w, offs_t, torch.ones(m, n))
    _assert_close(out, ref_out, torch.float32, "out")
    _assert_close(xg.grad, ref_dx, torch.float32, "dX")
    _assert_close(wg.grad, ref_dw, torch.float32, "dW")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_promise_skips_the_tail_mask_and_changes_no_number(dtype):
    """offs[-1] == M (forge's MoE dispatch): dense=True gives bit-identical out, dX and dW and
    runs no masked fill; without the promise the torch path masks (so the check can fail)."""
    m, k, n, offs = 37, 40, 24, [5, 5, 20, 37]
    x, w, offs_t, dout = _inputs(m, k, n, offs, dtype, seed=5)
    x, w, offs_t, dout = x.cpu(), w.cpu(), offs_t.cpu(), dout.cpu()

    def run(dense: bool):
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        seen: set[str] = set()

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.add(str(func.overloadpacket))
                return func(*args, **(kwargs or {}))

        with Ops():
            out = grouped_gemm(xg, wg, offs_t, backend="torch_grouped_mm", dense=dense)
            out.backward(dout)
        return (out, xg.grad, wg.grad), seen

    (masked, masked_ops), (lean, lean_ops) = run(False), run(True)
    for a, b in zip(masked, lean, strict=True):
        assert torch.equal(a, b)
    assert "aten.masked_fill" in masked_ops and "aten.masked_fill" not in lean_ops
    ref_out, ref_dx, ref_dw = _reference(x, w, offs_t, dout)
    _assert_close(lean[0], ref_out, dtype, "out")
    _assert_close(lean[1], ref_dx, dtype, "dX")
    _assert_close(lean[2], ref_dw, dtype, "dW")


@pytest.mark.parametrize("m,k,n,offs", CASES)
def test_reference_backend_matches_float64_reference(m, k, n, offs):
    x, w, offs_t, dout = _inputs(m, k, n, offs, torch.float32)
    x, w, offs_t, dout = x.cpu(), w.cpu(), offs_t.cpu(), dout.cpu()
    out, dx, dw = _run_autograd(x, w, offs_t, dout, "reference")
    ref_out, ref_dx, ref_dw = _reference(x, w, offs_t, dout)
    _assert_close(out, ref_out, torch.float32, "out")
    _assert_close(dx, ref_dx, torch.float32, "dX")
    _assert_close(dw, ref_dw, torch.float32, "dW")


# ---------------------------------------------------------------------------------------------
# Dispatcher and backend reporting
# ---------------------------------------------------------------------------------------------


def test_backend_reporting_on_cpu(monkeypatch):
    x = torch.zeros(4, 8)
    expected_auto = "torch_grouped_mm" if hasattr(torch, "_grouped_mm") else "reference"
    # TRITON_INTERPRET=1 is set in this module, and still the CPU default is not the interpreter.
    assert grouped_gemm_backend(x) == expected_auto
    assert grouped_gemm_backend(x.double()) == "reference"
    if _ON_GPU:  # no interpreter here (the module sets TRITON_INTERPRET only without a GPU)
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            grouped_gemm_backend(x, "triton")
    else:
        assert grouped_gemm_backend(x, "triton") == "triton"
    assert grouped_gemm_backend(x, "reference") == "reference"
    with pytest.raises(ValueError, match="choose one of"):
        grouped_gemm_backend(x, "cutlass")
    with pytest.raises(ValueError, match="use 'reference'"):
        grouped_gemm_backend(x.double(), "torch_grouped_mm")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        grouped_gemm_backend(x, "triton")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_dispatcher_runs_the_backend_it_reports(kern, monkeypatch):
    calls = {"torch": 0, "triton": 0}
    orig_mm, orig_rows = torch._grouped_mm, kern.gmm_rows

    def count_mm(*a, **kw):
        calls["torch"] += 1
        return orig_mm(*a, **kw)

    def count_rows(*a, **kw):
        calls["triton"] += 1
        return orig_rows(*a, **kw)

    # CPU: the default is torch._grouped_mm, Triton runs interpreted; GPU: the default is Triton
    dtype = torch.bfloat16 if _ON_GPU else torch.float32  # CUDA _grouped_mm: bf16 only
    x, w, offs, _ = _inputs(16, 16, 16, [8, 16], dtype)
    # the backend choice probes torch._grouped_mm once per (device, dtype): not a call to count
    # (the first H200 run counted it: {'torch': 2} on a fresh process)
    gg._torch_grouped_mm_works(x.device.type, x.dtype)
    monkeypatch.setattr(torch, "_grouped_mm", count_mm)
    monkeypatch.setattr(kern, "gmm_rows", count_rows)
    other = "torch_grouped_mm" if _ON_GPU else "triton"
    grouped_gemm(x, w, offs)
    assert calls == ({"torch": 0, "triton": 1} if _ON_GPU else {"torch": 1, "triton": 0})
    grouped_gemm(x, w, offs, backend=other)
    assert calls == {"torch": 1, "triton": 1}


def test_input_validation_errors_name_the_problem():
    x, w, offs = torch.zeros(4, 8), torch.zeros(2, 8, 4), torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="K=8 but w has K=6"):
        grouped_gemm(x, torch.zeros(2, 6, 4), offs)
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_gemm(x, w.half(), offs)
    with pytest.raises(ValueError, match="offs must be"):
        grouped_gemm(x, w, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="integer"):
        grouped_gemm(x, w, offs.float())
    with pytest.raises(ValueError, match="fp32_precision"):
        grouped_gemm(x, w, offs, fp32_precision="fast")


# ---------------------------------------------------------------------------------------------
# No host sync
# ---------------------------------------------------------------------------------------------

_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture
def forbid_host_reads(monkeypatch):
    """CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: any Tensor method that
    reads values on the host raises when called from forge_kernels code. Calls from elsewhere
    (the Triton interpreter copies its arguments through numpy) pass through."""

    def guard(name):
        orig = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("forge_kernels"):
                raise AssertionError(f"host read Tensor.{name}() from {caller}")
            return orig(self, *args, **kwargs)

        return method

    for name in _SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, guard(name))


@pytest.mark.parametrize("backend", ["triton", "torch_grouped_mm"])
def test_no_host_read_of_offs_in_forward_and_backward(kern, forbid_host_reads, backend):
    if backend == "torch_grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    x, w, offs, dout = _inputs(45, 48, 40, [0, 7, 7, 30, 39], torch.float32)
    if backend == "torch_grouped_mm":  # CUDA's _grouped_mm takes bf16 only: this runs on CPU
        x, w, offs, dout = x.cpu(), w.cpu(), offs.cpu(), dout.cpu()
    out, dx, dw = _run_autograd(x, w, offs, dout, backend)
    assert out.shape == (45, 40) and dx.shape == (45, 48) and dw.shape == (5, 48, 40)


def test_host_read_guard_catches_the_reference_loop(forbid_host_reads):
    x, w, offs, _ = _inputs(9, 8, 8, [3, 9], torch.float32)
    with pytest.raises(AssertionError, match="host read"):
        grouped_gemm(x.cpu(), w.cpu(), offs.cpu(), backend="reference")


# ---------------------------------------------------------------------------------------------
# GPU only (compiled, autotuned kernels)
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_triton_matches_reference_without_sync(dtype):
    m, k, n, offs = 1000, 256, 384, [0, 100, 100, 613, 777, 900]
    x, w, offs_t, dout = _inputs(m, k, n, offs, dtype)
    _run_autograd(x, w, offs_t, dout, "triton")  # autotune outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, dx, dw = _run_autograd(x, w, offs_t, dout, "triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_out, ref_dx, ref_dw = _reference(x, w, offs_t, dout)
    _assert_close(out, ref_out, dtype, "out")
    _assert_close(dx, ref_dx, dtype, "dX")
    _assert_close(dw, ref_dw, dtype, "dW")
    _check_zeros_past_offs(out, offs_t, "out")
    _check_zeros_past_offs(dx, offs_t, "dX")


@gpu
def test_gpu_triton_tf32_opt_in_is_within_tf32_error():
    m, k, n, offs = 300, 128, 96, [0, 64, 200, 250]
    x, w, offs_t, _ = _inputs(m, k, n, offs, torch.float32)
    out = grouped_gemm(x, w, offs_t, backend="triton", fp32_precision="tf32")
    ref = _reference(x, w, offs_t, torch.zeros(m, n))[0]
    assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < 5e-3


@gpu
def test_gpu_default_backend_is_triton():
    assert grouped_gemm_backend(torch.zeros(2, 2, device="cuda", dtype=torch.bfloat16)) == "triton"


@gpu
@pytest.mark.parametrize("kernel", ["rows", "ragged_k"])
def test_gpu_every_bf16_candidate_config_matches_the_reference(kern, kernel):
    # The autotuner keeps one config per shape, so each candidate (TMA or not) is run here by
    # itself, poisoned output, ragged groups with a group of several whole tiles and a tail.
    m, k, n, offs = 1200, 256, 384, [0, 130, 131, 700, 1100, 1100]
    x, w, offs_t, dout = _inputs(m, k, n, offs, torch.bfloat16, seed=5)
    ref_out, ref_dx, ref_dw = _reference(x, w, offs_t, dout)
    configs = dict.fromkeys(
        kern.candidates(kernel, fp32=False, tma=True) + kern.candidates(kernel, False, False)
    )
    assert any(c.tma for c in configs) and any(not c.tma for c in configs)
    for cfg in configs:
        what = f"{kernel} {cfg}"
        if kernel == "rows":
            out = kern.gmm_rows(
                x,
                w,
                offs_t,
                out=torch.full_like(ref_out, float("nan"), dtype=x.dtype, device=x.device),
                config=cfg,
            )
            dx = kern.gmm_rows(dout, w.transpose(1, 2), offs_t, config=cfg)
            _assert_close(out, ref_out, torch.bfloat16, f"out {what}")
            _assert_close(dx, ref_dx, torch.bfloat16, f"dX {what}")
            _check_zeros_past_offs(out, offs_t, f"out {what}")
        else:
            dw = kern.gmm_ragged_k(x, dout, offs_t, config=cfg)
            _assert_close(dw, ref_dw, torch.bfloat16, f"dW {what}")


def test_small_problems_get_one_autotune_candidate(kern):
    # A compile per candidate costs about a second on first use; a problem below
    # SMALL_PROBLEM_MACS runs in microseconds, so it is not worth tuning.
    from forge_kernels.grouped_gemm import _tuning as tuning

    small = kern._m_bucket(1000, 256, 384, 6)
    large = kern._m_bucket(65536, 2048, 768, 128)
    assert small == tuning.SMALL_BUCKET and large == 10  # 512 rows per expert
    configs = list(kern.candidates("rows", fp32=False, tma=True))
    assert tuning._prune_small(configs, {"M_BUCKET": small}) == configs[:1]
    assert tuning._prune_small(configs, {"M_BUCKET": large}) == configs


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_the_first_call_inside_selective_checkpointing_recomputes_the_same_ops():
    """The backend probe (one tiny ``torch._grouped_mm``, memoized) must not run inside the
    caller's dispatch modes: when the process's first grouped GEMM ran inside an op-level
    selective checkpoint (forge's ``ac_mode="op"``), the probe's matmul took the first
    ``_grouped_mm`` slot of the checkpoint's cache, the recompute (which skips the memoized
    probe) read it as the experts' output, and backward failed ("aten.alias.default
    encountered during backward"): ``forge train`` of an MoE with ep=2 and AC op did."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    def policy(ctx, func, *args, **kwargs):  # noqa: ANN001, ANN202 - torch's policy protocol
        saved = func is torch.ops.aten._grouped_mm.default
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    x, w, offs, _ = _inputs(12, 16, 16, [5, 12], torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)

    def experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # as GroupedExperts calls it
        return torch.nn.functional.silu(grouped_gemm(a, b, offs, dense=True))

    expected = torch.autograd.grad(experts(x, w).square().sum(), (x, w))
    gg._probe_grouped_mm.cache_clear()  # the process's first call: inside the checkpoint
    out = checkpoint(
        experts,
        x,
        w,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(policy),
    )
    got = torch.autograd.grad(out.square().sum(), (x, w))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
