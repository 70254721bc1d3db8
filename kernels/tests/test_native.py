"""Tests of forge_kernels.native: the CMake-built `forge` ops against the pure-PyTorch contract.

The native library must build and load on this machine (a failure fails, never skips: CI has
cmake, ninja and g++). The first build is cached under ~/.cache/forge-kernels (or
$FORGE_KERNELS_CACHE_DIR), so later runs load it in milliseconds. Build-logic tests (cache key,
lock, missing tools, fallback) use a temporary cache and fake builders: no second compile.
``FORGE_KERNELS_TEST_CUDA_BUILD=1`` adds a check that the CUDA sources compile with nvcc
(about a minute on 2 cores, then cached); CUDA-run tests need a GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from forge_kernels import native
from forge_kernels.native import _build

ALIGNS = (1, 8, 16)


@pytest.fixture(scope="module")
def forge_ops():
    """torch.ops.forge with the native library loaded (raises, so tests fail, if it cannot be)."""
    native.load_native(require=True)
    return torch.ops.forge


def _random_ids(
    T: int, K: int, E: int, *, seed: int, dtype: torch.dtype, live_experts: int | None = None
) -> torch.Tensor:
    """Top-k distinct experts per token, drawn from the first `live_experts` (others stay empty)."""
    gen = torch.Generator().manual_seed(seed)
    live = E if live_experts is None else live_experts
    scores = torch.rand(T, live, generator=gen)
    return scores.topk(min(K, live), dim=1).indices.to(dtype)


def _check_contract(ids: torch.Tensor, E: int, align: int, layout: native.RoutingLayout) -> None:
    """The routing_layout contract, checked slot by slot (independent of both implementations)."""
    n = ids.numel()
    capacity = n if align == 1 else n + E * (align - 1)
    flat = ids.reshape(-1).long()
    assert layout.counts.dtype == layout.offs.dtype == torch.int32
    assert layout.gather_idx.dtype == layout.scatter_idx.dtype == torch.int64
    assert layout.gather_idx.shape == (capacity,) and layout.scatter_idx.shape == (n,)
    counts = torch.bincount(flat, minlength=E)
    assert torch.equal(layout.counts.long(), counts)
    padded = (counts + align - 1) // align * align
    assert torch.equal(layout.offs.long(), padded.cumsum(0))
    expected_gather = torch.full((capacity,), n, dtype=torch.int64)
    start = 0
    for e in range(E):
        slots = (flat == e).nonzero().flatten()  # increasing slot order: the stable order
        expected_gather[start : start + len(slots)] = slots
        start += int(padded[e])
    assert torch.equal(layout.gather_idx, expected_gather)
    assert torch.equal(layout.gather_idx[layout.scatter_idx], torch.arange(n))


# --------------------------------------------------------------------------- build and load
def test_native_library_builds_and_loads_on_this_machine(forge_ops):
    assert native.native_error() is None
    assert native.implementation("cpu") == "native"
    path = native._STATE.library
    assert path is not None and path.is_file()
    assert path.parent.parent == _build.default_cache_root()
    assert path == _build.library_path(_build.resolve_config())
    assert hasattr(forge_ops, "routing_layout") and hasattr(forge_ops, "stage_to_host")


# --------------------------------------------------------------------------- routing layout
def test_routing_layout_follows_the_contract_on_a_hand_checked_routing(forge_ops):
    ids = torch.tensor([[1, 0], [1, 2], [0, 1]])  # slots 0..5 -> experts 1,0,1,2,0,1
    for impl in (forge_ops.routing_layout, native.routing_layout_reference):
        counts, offs, gather_idx, scatter_idx = impl(ids, 4, 4)
        assert counts.tolist() == [2, 3, 1, 0]
        assert offs.tolist() == [4, 8, 12, 12]
        s = 6  # sentinel T*K
        assert gather_idx.tolist() == [1, 4, s, s, 0, 2, 5, s, 3, s, s, s] + [s] * 6
        assert scatter_idx.tolist() == [4, 0, 5, 8, 1, 6]


ROUTINGS = [
    # (T, K, E, live experts, seed)
    (1, 1, 1, None, 0),
    (1, 2, 8, None, 1),
    (1, 4, 16, 4, 2),
    (7, 2, 4, None, 3),
    (64, 4, 16, 9, 4),
    (33, 8, 64, None, 5),
    (0, 2, 4, None, 6),
    (5000, 8, 64, 40, 7),  # 40,000 slots: more than one CPU chunk (32,768)
]


@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("T", "K", "E", "live", "seed"), ROUTINGS)
def test_native_routing_layout_equals_pytorch_fallback_exactly(
    forge_ops, T, K, E, live, seed, dtype, align
):
    ids = _random_ids(T, K, E, seed=seed, dtype=dtype, live_experts=live)
    got = native.RoutingLayout(*forge_ops.routing_layout(ids, E, align))
    want = native.routing_layout_reference(ids, E, align)
    for name, g, w in zip(got._fields, got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    if T * K <= 4096:
        _check_contract(ids, E, align, got)


@pytest.mark.parametrize("align", ALIGNS)
def test_routing_layout_with_repeated_experts_per_token_matches(forge_ops, align):
    ids = torch.randint(0, 6, (50, 4), generator=torch.Generator().manual_seed(11))
    got = forge_ops.routing_layout(ids, 6, align)
    want = native.routing_layout_reference(ids, 6, align)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    _check_contract(ids, 6, align, native.RoutingLayout(*got))


@pytest.mark.parametrize("align", ALIGNS)
def test_ids_outside_the_expert_range_are_dropped_identically(forge_ops, align):
    ids = torch.tensor([[0, -1], [3, 2], [4, 0], [2, 7]])  # E = 4: -1, 4, 7 are dropped
    got = native.RoutingLayout(*forge_ops.routing_layout(ids, 4, align))
    want = native.routing_layout_reference(ids, 4, align)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    capacity = native.routing_capacity(4, 2, 4, align)
    assert got.counts.tolist() == [2, 0, 2, 1]
    assert [got.scatter_idx[s].item() for s in (1, 4, 7)] == [capacity] * 3
    assert not torch.isin(torch.tensor([1, 4, 7]), got.gather_idx).any()


BAD_ROUTING = [
    (torch.zeros(4, dtype=torch.int64), 4, 1, "2-D"),
    (torch.zeros(2, 2), 4, 1, "int32 or int64"),
    (torch.zeros(2, 2, dtype=torch.int64), 0, 1, "num_experts"),
    (torch.zeros(2, 2, dtype=torch.int64), 4, 0, "align"),
]
BAD_STAGING = [
    (torch.zeros(4, dtype=torch.int64), "convert src"),
    (torch.zeros(5, dtype=torch.int32), "elements"),
    (torch.zeros(8, dtype=torch.int32)[::2], "contiguous"),
]

# The ops called with each bad argument in a child process: a C++ exception that crashes the
# process (as it did with the library built on the lent H200) then fails this one test with the
# signal named, instead of ending pytest and every count after it.
_BAD_ARGUMENTS_CHILD = """
import importlib.util, re, sys, torch
from forge_kernels import native
spec = importlib.util.spec_from_file_location("bad_cases", sys.argv[1])
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
native.load_native(require=True)
src = torch.arange(4, dtype=torch.int32)
calls = [(f"routing_layout {m}", lambda i=i, e=e, a=a: torch.ops.forge.routing_layout(i, e, a), m)
         for i, e, a, m in cases.BAD_ROUTING]
calls += [(f"stage_to_host {m}", lambda d=d: torch.ops.forge.stage_to_host(src, d), m)
          for d, m in cases.BAD_STAGING]
for name, call, match in calls:
    print("calling", name, flush=True)
    try:
        call()
    except ValueError as err:
        assert re.search(match, str(err)), (name, str(err))
        print("ValueError", name, flush=True)
    else:
        raise SystemExit(f"{name}: no error")
"""


def test_bad_arguments_to_the_ops_raise_value_error(forge_ops):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run(
        [sys.executable, "-c", _BAD_ARGUMENTS_CHILD, __file__],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    out = child.stdout + child.stderr
    if child.returncode < 0:
        last = [line for line in child.stdout.splitlines() if line.startswith("calling")][-1:]
        pytest.fail(f"signal {-child.returncode} killed the process at {last}:\n{out[-2000:]}")
    assert child.returncode == 0, out[-2000:]
    assert child.stdout.count("ValueError ") == len(BAD_ROUTING) + len(BAD_STAGING), out


@pytest.mark.parametrize(("ids", "E", "align", "match"), BAD_ROUTING)
def test_the_reference_raises_the_same_value_error(ids, E, align, match):
    with pytest.raises(ValueError, match=match):
        native.routing_layout_reference(ids, E, align)


def test_python_entry_points_refuse_bad_arguments_before_the_op(forge_ops, monkeypatch):
    """On the lent H200 a C++ exception out of the library crashed the process (SIGSEGV):
    forge's own entry points check in Python and never hand the op a bad argument."""

    def op_called(*args):
        raise AssertionError("the native op was called with a bad argument")

    monkeypatch.setattr(forge_ops, "routing_layout", op_called)
    monkeypatch.setattr(forge_ops, "stage_to_host", op_called)
    with pytest.raises(ValueError, match="2-D"):
        native.routing_layout(torch.zeros(4, dtype=torch.int64), 4, 1)
    with pytest.raises(ValueError, match="align must be >= 1"):
        native.routing_layout(torch.zeros(4, 2, dtype=torch.int64), 4, 0)
    with pytest.raises(ValueError, match="elements"):
        native.stage_to_host(torch.arange(4), torch.zeros(5, dtype=torch.int64))


def test_routing_layout_dispatches_to_the_native_op_on_cpu(forge_ops, monkeypatch):
    ids = _random_ids(16, 2, 8, seed=3, dtype=torch.int64)

    def fail(*args):
        raise AssertionError("fallback used although the native op is loaded")

    monkeypatch.setattr(native, "routing_layout_reference", fail)
    layout = native.routing_layout(ids, 8, 8)
    assert isinstance(layout, native.RoutingLayout)
    _check_contract(ids, 8, 8, layout)


# --------------------------------------------------------------------------- opcheck / compile
@pytest.mark.parametrize(
    ("T", "K", "E", "align", "dtype"),
    [(1, 1, 4, 1, torch.int64), (9, 2, 8, 8, torch.int32), (32, 4, 16, 16, torch.int64)],
)
def test_opcheck_routing_layout(forge_ops, T, K, E, align, dtype):
    ids = _random_ids(T, K, E, seed=T, dtype=dtype)
    torch.library.opcheck(forge_ops.routing_layout.default, (ids, E, align))


def test_opcheck_stage_to_host(forge_ops):
    src = torch.arange(6, dtype=torch.int32)
    torch.library.opcheck(forge_ops.stage_to_host.default, (src, torch.zeros(6, dtype=torch.int32)))


def _layout_and_stage(ids: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    counts, offs, gather_idx, scatter_idx = torch.ops.forge.routing_layout(ids, 8, 16)
    torch.ops.forge.stage_to_host(counts, host)
    return offs * 2, gather_idx[scatter_idx]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_traces_both_ops(forge_ops, backend):
    torch._dynamo.reset()
    ids = _random_ids(20, 2, 8, seed=5, dtype=torch.int64, live_experts=5)
    host_eager, host_compiled = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    want = _layout_and_stage(ids, host_eager)
    got = torch.compile(_layout_and_stage, backend=backend, fullgraph=True)(ids, host_compiled)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(host_compiled, host_eager)


def test_compile_fullgraph_dynamic_of_the_python_wrapper_and_the_fallback(forge_ops):
    torch._dynamo.reset()
    for fn in (native.routing_layout, native.routing_layout_reference):
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
        for T in (3, 12, 17):  # one graph, outputs sized symbolically from T
            ids = _random_ids(T, 4, 16, seed=T, dtype=torch.int32, live_experts=10)
            got, want = compiled(ids, 16, 8), native.routing_layout_reference(ids, 16, 8)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _stage_counts(ids: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor, ...]:
    counts, offs, gather_idx, scatter_idx = torch.ops.forge.routing_layout(ids, 8, 16)
    torch.ops.forge.stage_to_host(counts, host)
    return offs, gather_idx, scatter_idx


@pytest.mark.slow
def test_compile_with_inductor(forge_ops):
    # No pointwise work, so inductor emits only extern calls: the cost is importing inductor.
    torch._dynamo.reset()
    ids = _random_ids(20, 2, 8, seed=7, dtype=torch.int64)
    host = torch.zeros(8, dtype=torch.int32)
    got = torch.compile(_stage_counts, fullgraph=True)(ids, host)
    want = native.routing_layout_reference(ids, 8, 16)
    assert all(torch.equal(g, w) for g, w in zip(got, want[1:], strict=True))
    assert host.tolist() == want.counts.tolist()


# --------------------------------------------------------------------------- host staging
def test_staged_splits_round_trip_on_cpu(forge_ops):
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    staged = native.StagedSplits(4, device="cpu")
    assert staged.start(counts) is staged
    assert staged.ready()
    assert staged.wait() == [3, 0, 5, 1]
    staged.start(counts + 1)
    with pytest.raises(RuntimeError, match="never wait"):
        staged.start(counts)
    assert staged.wait() == [4, 1, 6, 2]
    with pytest.raises(RuntimeError, match="start\\(\\) first"):
        staged.wait()
    with pytest.raises(ValueError, match="elements"):
        staged.start(torch.zeros(5, dtype=torch.int64))


@pytest.mark.parametrize(("dst", "match"), BAD_STAGING)
def test_stage_to_host_checks_refuse_mismatched_buffers(dst, match):
    with pytest.raises(ValueError, match=match):
        native._check_stage_args(torch.arange(4, dtype=torch.int32), dst)


# --------------------------------------------------------------------------- build logic
def _copy_sources(dst: Path) -> Path:
    root = _build.default_source_dir()
    dst.mkdir(parents=True)
    shutil.copy2(root / "CMakeLists.txt", dst / "CMakeLists.txt")
    shutil.copytree(root / "kernels" / "csrc", dst / "kernels" / "csrc")
    return dst


def _config(source_dir: Path, cache_root: Path, **kw) -> _build.BuildConfig:
    fields = {"cuda": False, "cuda_archs": "", "jobs": 2, **kw}
    return _build.BuildConfig(source_dir=source_dir, cache_root=cache_root, **fields)


def test_cache_key_changes_exactly_when_sources_torch_or_cuda_settings_change(
    tmp_path, monkeypatch
):
    src = _copy_sources(tmp_path / "src")
    config = _config(src, tmp_path / "cache")
    key = _build.cache_key(config)
    assert _build.cache_key(_config(src, tmp_path / "other-cache", jobs=16)) == key

    ops_cpp = src / "kernels" / "csrc" / "ops.cpp"
    original = ops_cpp.read_bytes()
    ops_cpp.write_bytes(original + b"\n// edited\n")
    assert _build.cache_key(config) != key
    ops_cpp.write_bytes(original)
    os.utime(ops_cpp)  # timestamps do not matter, contents do
    assert _build.cache_key(config) == key

    (src / "kernels" / "csrc" / "new.cu").write_text("// new\n")
    assert _build.cache_key(config) != key
    (src / "kernels" / "csrc" / "new.cu").unlink()
    assert _build.cache_key(_config(src, tmp_path / "cache", cuda=True, cuda_archs="9.0")) != key
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert _build.cache_key(config) != key


def test_cached_library_is_reused_without_running_cmake(tmp_path, monkeypatch):
    config = _config(_copy_sources(tmp_path / "src"), tmp_path / "cache")
    target = _build.library_path(config)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"cached")

    def no_build(*args, **kwargs):
        raise AssertionError("cmake ran although the library is cached")

    monkeypatch.setattr(_build, "_cmake_build", no_build)
    monkeypatch.setattr(subprocess, "run", no_build)
    assert _build.build_library(config) == target


def test_concurrent_builders_of_one_key_build_once(tmp_path, monkeypatch):
    config = _config(_copy_sources(tmp_path / "src"), tmp_path / "cache")
    calls = []

    def fake_build(config, key_dir):
        calls.append(key_dir)
        time.sleep(0.3)  # others reach the lock meanwhile
        out = key_dir / "build" / "out" / _build.LIBRARY_NAME
        out.parent.mkdir(parents=True)
        out.write_bytes(b"lib")
        return out

    monkeypatch.setattr(_build, "_cmake_build", fake_build)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(_build.build_library(config)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [_build.library_path(config)] * 4
    assert results[0].read_bytes() == b"lib"
    assert not (results[0].parent / "build").exists()


@pytest.mark.parametrize("missing", ["cmake", "ninja", "c++"])
def test_missing_build_tool_is_named_in_the_error(monkeypatch, missing):
    real_which = shutil.which
    names = {"cmake": {"cmake"}, "ninja": {"ninja"}, "c++": {"c++", "g++", "clang++"}}[missing]
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda n, *a, **k: None if n in names else real_which(n))
    with pytest.raises(_build.NativeBuildError, match=re.escape(f"no {missing}")):
        _build.find_tools(search_dirs=[])


def test_failed_build_warns_and_falls_back_unless_required(monkeypatch):
    monkeypatch.setattr(native, "_STATE", native._NativeState())

    def broken(config=None):
        raise _build.NativeBuildError("no ninja found (test)")

    monkeypatch.setattr(_build, "build_library", broken)
    monkeypatch.delenv("FORGE_KERNELS_REQUIRE_NATIVE", raising=False)
    with pytest.warns(UserWarning, match="PyTorch fallback: no ninja found"):
        assert native.load_native() is False
    assert native.implementation("cpu") == "pytorch"
    assert "no ninja" in native.native_error()
    ids = _random_ids(5, 2, 4, seed=1, dtype=torch.int64)
    _check_contract(ids, 4, 8, native.routing_layout(ids, 4, 8))
    with pytest.raises(_build.NativeBuildError, match="required but unavailable"):
        native.load_native(require=True)
    monkeypatch.setenv("FORGE_KERNELS_REQUIRE_NATIVE", "1")
    with pytest.raises(_build.NativeBuildError):
        native.load_native()


def test_forge_kernels_native_0_forces_the_fallback_silently(monkeypatch):
    monkeypatch.setattr(native, "_STATE", native._NativeState())
    monkeypatch.setenv("FORGE_KERNELS_NATIVE", "0")
    monkeypatch.delenv("FORGE_KERNELS_REQUIRE_NATIVE", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load_native() is False
    assert native.implementation("cpu") == "pytorch"
    staged = native.StagedSplits(3, device="cpu")
    assert staged.start(torch.tensor([1, 2, 3])).wait() == [1, 2, 3]


@pytest.mark.skipif(
    os.environ.get("FORGE_KERNELS_TEST_CUDA_BUILD") != "1",
    reason="set FORGE_KERNELS_TEST_CUDA_BUILD=1 to compile the CUDA kernels (about a minute)",
)
def test_cuda_sources_compile_and_the_library_loads(forge_ops):
    if torch.version.cuda is None or _build.find_nvcc() is None:
        pytest.fail("FORGE_KERNELS_TEST_CUDA_BUILD=1 needs a CUDA build of torch and nvcc")
    env = {**os.environ, "FORGE_KERNELS_CUDA": "1"}
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    # A separate process: this one already holds the CPU-only library's `forge` ops.
    script = textwrap.dedent(
        """
        import torch
        from forge_kernels import native
        native.load_native(require=True)
        assert torch._C._dispatch_has_kernel_for_dispatch_key("forge::routing_layout", "CUDA")
        ids = torch.tensor([[1, 0], [1, 2]])
        print(native.routing_layout(ids, 3, 4).offs.tolist())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "[4, 8, 12]"


# --------------------------------------------------------------------------- on a GPU
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
def test_cuda_routing_layout_is_bit_identical_to_cpu_and_sync_free(forge_ops):
    for T, K, E, live, seed in [*ROUTINGS, (70000, 8, 128, 100, 9)]:
        for align in ALIGNS:
            ids = _random_ids(T, K, E, seed=seed, dtype=torch.int64, live_experts=live)
            want = forge_ops.routing_layout(ids, E, align)
            ids_cuda = ids.cuda()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = native.routing_layout(ids_cuda, E, align)
                reference = native.routing_layout_reference(ids_cuda, E, align)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for g, r, w in zip(got, reference, want, strict=True):
                assert torch.equal(g.cpu(), w) and torch.equal(r.cpu(), w), (T, K, E, align)
    if _build.find_nvcc() is not None:  # else the CUDA kernel cannot be built: fallback only
        assert native.implementation("cuda") == "native"


@cuda_only
def test_staged_splits_on_cuda_only_blocks_in_wait(forge_ops):
    counts = torch.arange(16, dtype=torch.int32, device="cuda")
    staged = native.StagedSplits(16, device="cuda")
    assert staged.host.is_pinned()
    torch.cuda.set_sync_debug_mode("error")
    try:
        staged.start(counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert staged.wait() == list(range(16))
    with pytest.raises(ValueError, match="pinned"):
        native.stage_to_host(counts, torch.zeros(16, dtype=torch.int32))


@cuda_only
def test_staged_splits_wait_is_reported_to_sync_debug_mode(forge_ops):
    # An event wait is a real host sync that torch's debug mode would not see by itself.
    staged = native.StagedSplits(4, device="cuda").start(torch.ones(4, device="cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="StagedSplits.wait synchronizes"):
            staged.wait()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cmake_and_ninja_are_only_the_native_extra():
    # The Triton and PyTorch paths import and run without a build toolchain (forge's workspace
    # installs the extra, so that the native ops build in development and CI).
    import tomllib
    from pathlib import Path

    layer = Path(__file__).resolve().parents[1]  # this layer's folder, beside tests/
    project = tomllib.loads((layer / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("<")[0] for dep in project["dependencies"]}
    assert not names & {"cmake", "ninja"}, project["dependencies"]
    native = project["optional-dependencies"]["native"]
    assert {d.split(">")[0] for d in native} == {"cmake", "ninja"}
