"""The GPU check of forge on a lent H100/H200, in calls that each fit its 8-minute budget.

Run through ``tools/gpu_check`` (it puts forge's sources on PYTHONPATH), from anywhere:

    tools/gpu_check fetch-wheels        # here, with network: torchao's wheel into .whl/
    tools/gpu_check tests               # GPU call (a): native build, CUDA tests, bench smokes
    tools/gpu_check bench               # GPU call (b): the benchmarks
    tools/gpu_check --cpu-dry-run       # both phases, every step that needs no CUDA (CI)

What each phase runs, as timed steps (each under ``timeout``, from the phase's deadline):

- both: install the carried wheels (``.whl/*.whl``, ``pip install --no-deps --target`` into a
  temporary folder put first on PYTHONPATH), report the environment (device, driver, python,
  torch, triton, torchao), build and load the native ops (``FORGE_KERNELS_REQUIRE_NATIVE=1``,
  with CUDA: ``FORGE_KERNELS_CUDA=1``).
- ``tests``: the native op's error path (a bad argument must raise ValueError; in a process of
  its own), then pytest over ``kernels/tests packages/forge-moe-ep/tests/test_moe.py packages/forge-core/tests/test_sync_guard.py
  packages/forge-cp/tests/test_cp_units.py``
  (plus ``packages/forge-float8/tests`` when torchao imports) with ``FORGE_KERNELS_TEST_CUDA_BUILD=1``; their
  CUDA cases run in bf16 under sync debug mode "error". Then ``tools/nccl_probe.py`` (NCCL with
  several ranks on the one GPU, and forge build's parity job on it when NCCL allows), then a
  smoke run of every benchmark (``--no-smokes`` leaves them to a bench call that follows);
  last, only when the error path crashed, its diagnosis (ldd, a backtrace, the exception matrix
  of ``tools/native_exception_probe.py``), so that its builds never take the tests' time.
- ``bench``: every benchmark at a size that fits, its page written to the output folder.
- ``--cpu-dry-run`` (CUDA hidden, native ops built for CPU): the same steps, except that pytest
  collects the whole selection and runs only a small part of it, and the benchmarks run at
  their ``--quick`` size, once (a dry run of both phases leaves the smokes to the bench phase).
  The GPU-image CI lane runs it (``tools/gpu_image_env``), in about 1.5 minutes on 2 cores.

Outputs go to ``--out``, else ``$OUT`` when set, else ``benchmarks/`` (dry run:
``build/gpu_check/dry-run/``): per phase ``gpu_check-<date>-<phase>.md`` (environment, steps,
test counts, targets, output tails) and ``gpu_check-<date>-<phase>.log`` (everything printed);
the bench phase adds the benchmarks' pages. Caches and scratch files live in
``build/gpu_check/``. stdout gets step tails and, last, the summary table: each step (result,
seconds), the test counts, and every target the benchmarks recorded
(``benchlib.record_target`` through ``$FORGE_BENCH_SUMMARY``).

Why this shape: the lent machines allow 10 minutes per command and 30 per session, return only
the last 12,000 characters of output plus at most 8 files from ``$OUT``, and have no network
(and no torchao). So every step has a budgeted timeout and reports its time, the full logs go to
files, and the missing package travels as a wheel fetched here beforehand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / "build" / "gpu_check"
WHEEL_DIR = ROOT / ".whl"

# NOTE: torchao for the lent machines' torch 2.11. torchao's compatibility table
# (github.com/pytorch/ao/issues/2919) pairs 0.17.0 with torch 2.11.0+ and says torchao is ABI
# stable against torch 2.11 from 0.17.0 on; 0.18.0's torchao/__init__.py loads its C++
# extensions for any torch >= 2.11.0 (0.16.0 and older only for the exact torch they were built
# for). Tested 2026-11-24 in tools/gpu_image_env (torch 2.11.0+cu130, CPU), each release
# installed with `--no-deps --target` and `pytest packages/forge-float8/tests`: 0.14.1, 0.15.0, 0.16.0, 0.17.0
# and 0.18.0 all gave 9 passed, 2 failed, the same two failures for each, both torch 2.11's and
# not torchao's (they pass with torch 2.15 + torchao 0.18.0 in the main lane):
# `[fsdp2xtp-rowwise]` (torch 2.11's CPU `_scaled_mm` supports only per-tensor scales) and
# `test_fsdp_fp8_all_gather_matches_bf16_all_gather...` (step-1 loss difference 5.2e-4 > 1e-4).
# 0.18.0's extensions load under torch 2.11 without a warning. So: the newest, 0.18.0, which is
# also the version uv.lock pins for the main lane. It declares no runtime dependencies (only
# "dev" extras), so nothing else needs carrying.
# NOTE: torchtitan 0.3.0 (the bench group's peer, tools/bench_moe.py's torchtitan column) and
# what its MoE, ParallelDims and config helpers import that the lent image lacks; versions as
# uv.lock pins them. Its datasets/wandb requirements are not imported on that path (checked
# 2026-11-27 with the GPU-image venv: torch 2.11, tools/bench_moe.py --quick ran both columns).
CARRIED = {
    "torchao": "0.18.0",
    "torchtitan": "0.3.0",
    "torchdata": "0.11.0",
    "torch-checkpointing": "0.1.1",
    "spmd-types": "0.2.3",
    "tyro": "1.0.17",
    "docstring-parser": "0.18.0",
    "typeguard": "4.6.0",
}
GPU_PYTHON = "3.12"  # the lent machines' python3 (3.12.3)
GPU_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

TESTS = (
    "kernels/tests",
    "packages/forge-moe-ep/tests/test_moe.py",
    "packages/forge-core/tests/test_sync_guard.py",
    "packages/forge-cp/tests/test_cp_units.py",  # the CUDA lower-right causal bias of forge-cp's kernel
)
FLOAT8_TESTS = ("packages/forge-float8/tests", "tests/integration/float8")
NATIVE_TESTS = "kernels/tests/test_native.py"
# NOTE: the dry run's real pytest run: the native ops' tests (they load the library the build
# step made) and the sync guard; the full CPU suite runs elsewhere in the GPU-image lane.
DRY_RUN_TESTS = ("kernels/tests/test_native.py", "packages/forge-core/tests/test_sync_guard.py")
# NOTE: 8 minutes per call (the issue), less what the machine needs around the command.
DEFAULT_BUDGET_S = 460.0
MIN_STEP_S = 5.0


@dataclass(frozen=True)
class Bench:
    """One benchmark script and how each phase runs it."""

    name: str
    script: str
    full: tuple[str, ...]  # the bench phase's arguments on a GPU
    page: str  # its page under benchmarks/
    cap_s: float  # bench-phase timeout at most
    reserve_s: float  # time kept for it while earlier bench-phase steps run
    smoke_cap_s: float = 90.0
    smoke_reserve_s: float = 25.0


# NOTE: the bench phase's sizes are set so that they fit next to the native build in one call of
# about 5 minutes; each is cut by its timeout rather than the call by the machine (caps are
# estimates: the pages and the log record each step's time, so adjust them from a real run).
# In the priority order: grouped GEMM, the MoE layer against torchtitan, the ~1B training
# step (bf16 MFU, Float8), the planner's rates, the combine kernel.
BENCHES = (
    Bench(
        "grouped_gemm",
        "tools/bench_grouped_gemm.py",
        ("--tokens", "8192", "--reps", "10", "--no-compile-check"),
        "grouped_gemm.md",
        120,
        50,
    ),
    # every config one by one, warp-specialized experiments included (not yet autotuned)
    Bench("gemm_sweep", "tools/sweep_grouped_gemm.py", (), "grouped_gemm_sweep.md", 150, 40),
    Bench("moe", "tools/bench_moe.py", ("--reps", "10"), "moe.md", 100, 45),
    Bench(
        "float8",
        "tools/bench_float8.py",
        ("--reps", "8", "--recipes", "bf16", "tensorwise", "rowwise"),
        "float8.md",
        150,
        60,
    ),
    # forge train itself (CLI, one rank, ~1B bf16, eager then compiled): the user's MFU
    # the user's default (compiled: FSDP2 on the one rank, fused AdamW) and what FSDP2 costs
    Bench(
        "train",
        "tools/bench_train.py",
        ("--variants", "compiled,compiled-no-fsdp2,eager"),
        "train.md",
        240,
        60,
    ),
    Bench("gpu_rates", "tools/bench_gpu_rates.py", ("--reps", "10"), "gpu_rates.md", 60, 25),
    Bench("permute", "tools/bench_permute.py", (), "permute.md", 60, 20),
)

ENV_SNIPPET = """
import importlib.metadata, os, platform, shutil, subprocess, sys
import torch

def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"

smi = shutil.which("nvidia-smi")
query = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
if smi:
    out = subprocess.run([smi, *query], capture_output=True, text=True, timeout=30)
    print("driver:", (out.stdout + out.stderr).strip().replace("\\n", "; "))
else:
    print("driver: no nvidia-smi")
print("python:", platform.python_version(), sys.executable)
print("torch:", torch.__version__, "| CUDA", torch.version.cuda)
for name in ("triton", "torchao", "numpy", "transformers"):
    print(f"{name}:", version(name))
print("cpu:", platform.machine(), os.cpu_count(), "cores")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB,",
          f"{p.multi_processor_count} SMs, {torch.cuda.device_count()} visible")
else:
    print("gpu: none visible to torch")
    if sys.argv[1] == "cuda":
        sys.exit("no CUDA device: run on a GPU machine, or use --cpu-dry-run")
"""

NATIVE_SNIPPET = """
import sys, time
t = time.perf_counter()
from forge_kernels import native
from forge_kernels.native import _build
native.load_native(require=True)
print("library:", _build.library_path(_build.resolve_config()))
print("routing_layout on cpu:", native.implementation("cpu"))
if sys.argv[1] == "cuda":
    print("routing_layout on cuda:", native.implementation("cuda"))
    assert native.implementation("cuda") == "native", "the CUDA kernels did not build"
print(f"built or loaded in {time.perf_counter() - t:.1f} s")
# the compilers, to compare with torch's own (a C++ exception crossing the library crashed the
# process on the first GPU run, 2026-11-27, and nothing recorded what built it)
log = _build.library_path(_build.resolve_config()).parent / "build.log"
for line in (log.read_text().splitlines() if log.is_file() else ["no build.log"]):
    if "compiler identification" in line:
        print(line.strip("- "))
import torch
info = torch.__config__.show().splitlines()
print("torch built with:", "; ".join(x.strip("- ") for x in info if "GCC" in x or "C++" in x))
print("torch CXX11 ABI:", torch._C._GLIBCXX_USE_CXX11_ABI)
"""

# A C++ exception thrown by the native op, in a process of its own: it must reach Python as a
# ValueError (the first GPU run's library crashed the process instead).
NATIVE_ERROR_SNIPPET = """
import torch
from forge_kernels import native
native.load_native(require=True)
try:
    torch.ops.forge.routing_layout(torch.zeros(4, dtype=torch.int64), 4, 1)
except ValueError as err:
    print("a bad argument raised ValueError:", str(err).splitlines()[0])
else:
    raise SystemExit("a 1-D expert_ids tensor was accepted")
"""

# Run only when the error path crashed: where (gdb's backtrace, when gdb is there), what the
# library links, and whether the same op built without the CUDA kernels raises cleanly.
NATIVE_DIAGNOSIS_SCRIPT = """
py=$1; snippet=$2
lib=$("$py" -c "from forge_kernels.native import _build; print(_build.library_path(_build.resolve_config()))")
echo "--- ldd $lib"; ldd "$lib" | grep -E "stdc|gcc_s|cudart|c10|torch" || true
if command -v gdb >/dev/null; then
  echo "--- gdb backtrace"
  gdb -q -batch -ex run -ex bt --args "$py" -c "$snippet" 2>&1 | grep -E "^#|signal" | head -30
else
  echo "--- no gdb on this machine"
fi
# NOTE: a CPU-only build and ops.cpp through load_inline crash the same way (2026-11-27, third
# lease): the matrix library tells which of the op's features makes the difference.
echo "--- one-difference matrix (tools/native_exception_probe.py --matrix)"
"$py" tools/native_exception_probe.py --matrix /tmp/forge-exception-matrix 2>&1 | grep -v Warn
"""

IMPORT_SNIPPET = """
import sys, torch, torchao
where = torchao.__file__
print("torchao", torchao.__version__, "with torch", torch.__version__, "from", where)
assert where.startswith(sys.argv[1]), "torchao was not imported from the carried wheel"
if torchao.__version__ != sys.argv[2]:
    print(f"WARNING: carried torchao {torchao.__version__}, gpu_check pins {sys.argv[2]}")
"""


# --------------------------------------------------------------------------- steps
@dataclass
class Step:
    """One command of a phase. ``argv`` may be a callable, resolved when the step starts (it
    depends on earlier steps); None skips the step with ``skip_note``."""

    name: str
    argv: list[str] | None | Callable[[], list[str] | None]
    cap_s: float
    reserve_s: float
    tail: int = 6
    skip_note: str = ""
    after: Callable[[Result], None] | None = None
    shown: str = ""  # what stdout shows of the command (the log has all of it)


@dataclass
class Result:
    """What one step did: status is ok, FAIL, TIMEOUT, skipped or NO TIME."""

    name: str
    status: str
    seconds: float = 0.0
    timeout_s: float | None = None
    command: str = ""
    output: str = ""
    note: str = ""
    shown: str = ""

    @property
    def bad(self) -> bool:
        return self.status in ("FAIL", "TIMEOUT", "NO TIME")


def _short(line: str, width: int = 150) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def _tail(text: str, n: int) -> list[str]:
    """The last ``n`` non-blank lines of ``text``, each shortened."""
    lines = [line for line in text.splitlines() if line.strip()]
    return [_short(line) for line in lines[-n:]] if n else []


@dataclass
class Phase:
    """Runs steps against one deadline, logging everything to ``log`` and tails to stdout."""

    name: str
    dry_run: bool
    budget_s: float
    log: Path
    env: dict[str, str]
    t0: float = field(default_factory=time.monotonic)
    results: list[Result] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():4.0f} s] {text}", flush=True)

    def run(self, steps: Sequence[Step]) -> None:
        for i, step in enumerate(steps):
            # NOTE: a step already known to be skipped (argv None) keeps no time back: the third
            # lease's tests step got 120 s of a 330 s budget while six skipped smokes kept 150 s.
            later = sum(s.reserve_s for s in steps[i + 1 :] if s.argv is not None)
            result = self._run_one(step, later)
            self.results.append(result)
            if step.after is not None:
                step.after(result)

    def _run_one(self, step: Step, later_reserve_s: float) -> Result:
        """Run ``step`` with a timeout of at most its cap, leaving the later steps their
        reserves where the budget allows, and never less than its own reserve (time allowing:
        when the budget is short, steps run in order rather than the last ones first)."""
        argv = step.argv() if callable(step.argv) else step.argv
        if argv is None:
            self.say(f"{step.name}: skipped ({step.skip_note})")
            return Result(step.name, "skipped", note=step.skip_note)
        left_s = self.budget_s - self.elapsed()
        timeout_s = min(step.cap_s, max(left_s - later_reserve_s, step.reserve_s), left_s)
        command = shlex.join(str(a).replace(str(ROOT) + "/", "") for a in argv)
        if timeout_s < MIN_STEP_S:
            self.say(f"{step.name}: NO TIME left in the {self.budget_s:.0f} s budget")
            return Result(step.name, "NO TIME", command=command, note="budget spent")
        self.say(f"{step.name} (timeout {timeout_s:.0f} s): {_short(step.shown or command, 110)}")
        with self.log.open("ab") as f:
            f.write(f"\n===== {step.name} | timeout {timeout_s:.0f} s\n$ {command}\n".encode())
            f.flush()
            start_byte = f.tell()
            t = time.monotonic()
            # NOTE: `timeout` signals the whole process group it leads, so pytest's and the
            # benchmarks' worker processes go too; --kill-after for a child that ignores TERM.
            proc = subprocess.Popen(
                ["timeout", "--kill-after=10", f"{timeout_s:.0f}", *argv],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
            try:
                rc = proc.wait()
            except BaseException:  # e.g. Ctrl-C: TERM to `timeout`, which passes it on
                proc.terminate()
                proc.wait()
                raise
            seconds = time.monotonic() - t
        with self.log.open("rb") as f:
            f.seek(start_byte)
            output = f.read().decode(errors="replace")
        status = "ok" if rc == 0 else "TIMEOUT" if rc in (124, 137) else "FAIL"
        with self.log.open("a") as f:
            f.write(f"===== {step.name}: {status} (exit {rc}) in {seconds:.1f} s\n")
        self.say(f"{step.name}: {status} in {seconds:.1f} s" + (f" (exit {rc})" if rc else ""))
        for line in _tail(output, step.tail if status == "ok" else max(step.tail, 15)):
            print(f"    | {line}")
        return Result(step.name, status, seconds, timeout_s, command, output, shown=step.shown)


# --------------------------------------------------------------------------- wheels
def _has_pip(python: str) -> bool:
    return subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0


def _python_with_pip() -> str | None:
    """An interpreter that has pip: this one, else python3 on PATH."""
    candidates = (sys.executable, shutil.which("python3"))
    return next((python for python in candidates if python and _has_pip(python)), None)


def fetch_wheels() -> int:
    """Download the carried packages for the GPU machines (cp312, manylinux x86_64) to .whl/."""
    python = _python_with_pip()
    if python is None:
        print("fetch-wheels: no pip found (tried this python and python3 on PATH)")
        return 1
    WHEEL_DIR.mkdir(exist_ok=True)
    for name, version in CARRIED.items():
        stem = name.replace("-", "_")  # a wheel's file name spells the project with "_"
        for old in WHEEL_DIR.glob(f"{stem}-*.whl"):
            if not old.name.startswith(f"{stem}-{version}-"):
                # NOTE: the install takes every wheel in .whl/, so one version per package.
                print(f"removing {old.name} (gpu_check carries {name} {version})")
                old.unlink()
        platforms = [arg for p in GPU_PLATFORMS for arg in ("--platform", p)]
        cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", GPU_PYTHON, "--implementation", "cp", *platforms]
        cmd += ["-d", str(WHEEL_DIR), f"{name}=={version}"]
        print("$", shlex.join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            return 1
    for wheel in sorted(WHEEL_DIR.glob("*.whl")):
        print(f"{wheel.relative_to(ROOT)}  {wheel.stat().st_size / 2**20:.1f} MiB")
    return 0


def carried_wheels() -> list[Path]:
    return sorted(WHEEL_DIR.glob("*.whl"))


def install_argv(site: Path) -> list[str] | None:
    """Install .whl/*.whl into ``site`` with pip (the GPU machines') or, where this python has
    no pip (the GPU-image venv), uv; then import torchao from there."""
    wheels = [str(w) for w in carried_wheels()]
    if not wheels:
        return None
    if not _has_pip(sys.executable):
        uv = shutil.which("uv") or "uv"
        install = [uv, "pip", "install", "--quiet", "--no-index", "--no-deps"]
        install += ["--python", sys.executable, "--target", str(site), *wheels]
    else:
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        install += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *wheels]
    script = shlex.join(install)
    if any(Path(w).name.startswith("torchao-") for w in wheels):
        # NOTE: -W: torchao 0.18 has an invalid escape in a docstring, reported at first compile.
        check = [sys.executable, "-W", "ignore::SyntaxWarning", "-c", IMPORT_SNIPPET, str(site)]
        check.append(CARRIED["torchao"])
        pythonpath = shlex.quote(str(site)) + "${PYTHONPATH:+:$PYTHONPATH}"
        script += f" && PYTHONPATH={pythonpath} {shlex.join(check)}"
    return ["bash", "-c", script]


# --------------------------------------------------------------------------- pytest results
@dataclass
class TestCounts:
    """Counts from a pytest junit file (or a --collect-only run)."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    collected: int | None = None
    failures: list[str] = field(default_factory=list)
    skip_reasons: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        text = f"{self.passed} passed, {self.failed} failed, {self.errors} errors, "
        text += f"{self.skipped} skipped"
        return text + (f" ({self.collected} collected)" if self.collected is not None else "")


def read_junit(path: Path, counts: TestCounts) -> bool:
    """Add the outcomes in a junit file to ``counts``; False when there is none."""
    if not path.is_file():
        return False
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts.passed += 1
        elif outcome.tag == "skipped":
            counts.skipped += 1
            counts.skip_reasons[_short(outcome.get("message", ""), 100)] += 1
        else:
            if outcome.tag == "failure":
                counts.failed += 1
            else:
                counts.errors += 1
            message = (outcome.get("message") or "").strip().splitlines()
            counts.failures.append(_short(f"{test}: {message[0] if message else outcome.tag}"))
    return True


def collected_count(output: str) -> int | None:
    found = re.findall(r"(\d+)(?:/\d+)? tests? collected", output)
    return int(found[-1]) if found else None


# --------------------------------------------------------------------------- phases
@dataclass
class Run:
    """What one invocation shares across its phases."""

    dry_run: bool
    out_dir: Path
    budget_s: float
    benches: tuple[Bench, ...]
    site: Path
    smoke_in_bench: bool = False  # the tests phase leaves the smokes out (the bench phase runs)
    date: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    )
    site_ready: bool = False

    def env(self, targets: Path) -> dict[str, str]:
        env = dict(os.environ)
        if self.site_ready:
            env["PYTHONPATH"] = f"{self.site}:{env.get('PYTHONPATH', '')}".rstrip(":")
        env["FORGE_KERNELS_REQUIRE_NATIVE"] = "1"
        env["FORGE_KERNELS_CUDA"] = "0" if self.dry_run else "1"
        if self.dry_run:
            env["CUDA_VISIBLE_DEVICES"] = ""  # NOTE: a dry run is a CPU run, even on a GPU box
            env.pop("FORGE_KERNELS_TEST_CUDA_BUILD", None)
        else:
            env["FORGE_KERNELS_TEST_CUDA_BUILD"] = "1"
        # NOTE: caches in the checkout (ignored build/), not in $HOME: nothing outside the
        # repository is read on the GPU machine, and a warm machine reuses them between calls.
        env.setdefault("FORGE_KERNELS_CACHE_DIR", str(SCRATCH / "forge-kernels"))
        env.setdefault("TRITON_HOME", str(SCRATCH / "triton-home"))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(SCRATCH / "inductor"))
        env["FORGE_BENCH_SUMMARY"] = str(targets)
        env["PYTHONUNBUFFERED"] = "1"
        return env


def common_steps(run: Run, phase: Phase) -> list[Step]:
    """Wheels, environment report, native build: the start of every phase."""
    device = "cpu" if run.dry_run else "cuda"

    def wheels_done(result: Result) -> None:
        if result.status == "ok":
            run.site_ready = True
            phase.env.update(run.env(Path(phase.env["FORGE_BENCH_SUMMARY"])))

    py = sys.executable
    if run.site_ready:
        skip_note = "already installed"
    else:
        skip_note = "no .whl/*.whl: run `tools/gpu_check fetch-wheels` with network first"
    installer = "pip" if _has_pip(py) else "uv pip"
    return [
        Step(
            "wheels",
            lambda: None if run.site_ready else install_argv(run.site),
            60,
            30,
            tail=2,
            skip_note=skip_note,
            after=wheels_done,
            shown=f"{installer} install --no-deps --target {run.site} .whl/*.whl; import torchao",
        ),
        Step(
            "environment",
            [py, "-c", ENV_SNIPPET, device],
            60,
            10,
            tail=0,
            shown="python -c <nvidia-smi, versions, device>",
        ),
        Step(
            "native build",
            [py, "-c", NATIVE_SNIPPET, device],
            200,
            90,  # a fresh CUDA build on the H200 took more than 30 s (2026-11-27, second run)
            tail=7,
            shown=f"python -c <forge_kernels.native.load_native(require=True)> ({device})",
        ),
    ]


def native_error_steps() -> tuple[Step, Step]:
    """The native op's error path in a process of its own, then, only when it crashed, the
    diagnosis. The tests phase runs the first right after the build and the diagnosis last, so
    that its builds never take the tests' time; the bench phase runs neither (the third lease's
    crash would have run the diagnosis in both phases)."""
    py = sys.executable
    crashed: list[bool] = []
    error_path, diagnosis = (
        Step(
            "native error path",
            [py, "-c", NATIVE_ERROR_SNIPPET],
            30,
            5,
            tail=1,
            after=lambda result: crashed.append(result.status != "ok"),
            shown="python -c <torch.ops.forge.routing_layout(1-D ids) raises ValueError>",
        ),
        Step(
            "native error diagnosis",
            lambda: (
                [
                    "bash",
                    "-c",
                    NATIVE_DIAGNOSIS_SCRIPT,
                    "diagnose",
                    py,
                    NATIVE_ERROR_SNIPPET,
                ]
                if any(crashed)
                else None
            ),  # fmt: skip
            120,
            0,
            tail=40,
            skip_note="the error path raised ValueError",
            shown="ldd, gdb backtrace, the one-difference exception matrix",
        ),
    )
    return error_path, diagnosis


def _gpu_count() -> int:
    """GPUs nvidia-smi lists (0 without it), without initializing CUDA in this process."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    return sum(line.startswith("GPU ") for line in out.splitlines())


def torchao_found(env: dict[str, str]) -> bool:
    """Whether torchao is importable with ``env``; decided as packages/forge-float8/tests/float8_markers.py's
    ``needs_torchao`` decides it (``find_spec``), so the selection matches what would skip."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchao') is None)"
    return subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT).returncode == 0


def tests_phase(run: Run, phase: Phase, counts: TestCounts) -> list[Step]:
    py = sys.executable
    junit = SCRATCH / f"junit-{phase.name}.xml"
    junit.unlink(missing_ok=True)
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider"]

    def selection() -> list[str]:
        return [*TESTS, *(FLOAT8_TESTS if torchao_found(phase.env) else ())]

    def test_run(paths: Sequence[str], xml: Path = junit) -> list[str]:
        # NOTE: -v names each test as it ends, so a step cut by its timeout (the junit report
        # is written only at the end) still shows in the log which tests failed before the cut.
        return [*pytest, *paths, "-v", "-rfE", "--durations=15", f"--junitxml={xml}"]

    def reader(xml: Path) -> Callable[[Result], None]:
        def read(result: Result) -> None:
            if not read_junit(xml, counts) and result.status != "skipped":
                counts.failures.append(f"no junit report from {xml.name} ({result.status})")

        return read

    read = reader(junit)

    def collected(result: Result) -> None:
        counts.collected = collected_count(result.output)

    error_path, diagnosis = native_error_steps()
    steps = [*common_steps(run, phase), error_path]
    if run.dry_run:
        collect = Step(
            "test collection",
            lambda: [*pytest, *selection(), "--collect-only", "-q"],
            120,
            20,
            tail=1,
            after=collected,
        )
        steps += [
            collect,
            Step("tests (dry-run part)", test_run(DRY_RUN_TESTS), 180, 30, 2, after=read),
        ]
    else:
        # NOTE: the native ops' tests in a pytest of their own: a crash in the library (as on
        # the first GPU run) then costs only their counts, not every test's.
        native_xml = SCRATCH / f"junit-{phase.name}-native.xml"
        native_xml.unlink(missing_ok=True)
        steps.append(
            Step(
                "tests (native ops)",
                test_run([NATIVE_TESTS], native_xml),
                90,
                30,
                2,
                after=reader(native_xml),
            )
        )
        rest = ["--ignore", NATIVE_TESTS]
        steps.append(
            Step("tests", lambda: test_run([*selection(), *rest]), 300, 120, 2, after=read)
        )
    # NCCL with every rank on the one GPU, then forge build's parity job on it (gloo in a dry run)
    probe = [py, "tools/nccl_probe.py", "--device", "cpu" if run.dry_run else "cuda"]
    nccl_runs = run.dry_run or _gpu_count() >= 2
    # NOTE: NCCL 2.28 refuses two ranks on one device (the 2026-11-27 H200 run): on one GPU the
    # probe would only repeat that, so it runs in a dry run (gloo) or with two GPUs or more.
    steps.append(
        Step(
            "nccl probe",
            lambda: [*probe, "--timeout", "75"] if nccl_runs else None,
            170,
            40 if nccl_runs else 0,
            tail=4,
            skip_note="one GPU: NCCL refuses two ranks on one device",
        )
    )
    for b in run.benches:
        argv = None if run.smoke_in_bench else [py, b.script, "--quick", "--no-write"]
        steps.append(
            Step(
                f"smoke {b.name}",
                argv,
                b.smoke_cap_s,
                b.smoke_reserve_s,
                tail=2,
                skip_note="the bench phase runs it (--no-smokes, or a dry run of both phases)",
            )
        )
    return [*steps, diagnosis]


def bench_phase(run: Run, phase: Phase) -> list[Step]:
    py = sys.executable
    steps = common_steps(run, phase)
    for b in run.benches:
        page = run.out_dir / b.page
        args = ["--quick"] if run.dry_run else list(b.full)
        steps.append(
            Step(
                f"bench {b.name}",
                [py, b.script, *args, "--out", str(page)],
                b.cap_s,
                b.reserve_s,
                2,
            )
        )
    return steps


# --------------------------------------------------------------------------- report
def read_targets(path: Path) -> list[dict[str, object]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def verdict(met: object) -> str:
    return "n/a" if met is None else "met" if met else "NOT met"


def summary_lines(
    phase: Phase, counts: TestCounts | None, targets: list[dict[str, object]]
) -> list[str]:
    kind = "CPU dry run" if phase.dry_run else "GPU"
    lines = [
        f"gpu_check {phase.name} ({kind}): {phase.elapsed():.0f} s of a {phase.budget_s:.0f} s "
        "budget",
        "",
        "| step | result | s | timeout s |",
        "|---|---|---:|---:|",
    ]
    for r in phase.results:
        timeout = "" if r.timeout_s is None else f"{r.timeout_s:.0f}"
        note = f" ({r.note})" if r.note and r.status == "skipped" else ""
        lines.append(f"| {r.name} | {r.status}{note} | {r.seconds:.1f} | {timeout} |")
    lines.append("")
    if counts is not None:
        lines.append(f"tests: {counts.line()}")
        lines += [f"- FAILED {f}" for f in counts.failures[:12]]
        if len(counts.failures) > 12:
            lines.append(f"- ... {len(counts.failures) - 12} more in the log")
    if targets:
        if phase.name == "tests":
            lines.append("targets (smoke sizes; the bench phase measures them for real):")
        if lines[-1]:
            lines.append("")
        lines += ["| bench | target | measured | verdict |", "|---|---|---|---|"]
        for t in targets:
            lines.append(
                f"| {t['bench']} | {t['target']} | {t['measured']} | {verdict(t['met'])} |"
            )
    else:
        lines.append("targets: none recorded")
    return lines


def write_markdown(
    run: Run, phase: Phase, argv: Sequence[str], summary: list[str], counts: TestCounts | None
) -> Path:
    md = run.out_dir / f"gpu_check-{run.date}-{phase.name}.md"
    env = next((r for r in phase.results if r.name == "environment"), None)
    facts = [line for line in (env.output.splitlines() if env else []) if ": " in line]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    kind = " (CPU dry run)" if phase.dry_run else ""
    lines = [
        f"# tools/gpu_check {phase.name}{kind}, {now}",
        "",
        f"Command: `tools/gpu_check {shlex.join(argv)}`; everything printed is in "
        f"`{phase.log.name}`.",
        "",
        "## Environment",
        "",
        *[f"- {line}" for line in facts],
        "",
        "## Summary",
        "",
        *summary,
        "",
    ]
    if counts is not None and counts.skip_reasons:
        lines += ["## Skipped tests, by reason", ""]
        lines += [f"- {n} x {reason}" for reason, n in counts.skip_reasons.most_common(12)]
        lines.append("")
    lines += ["## Steps (last lines of each; all of it in the log)", ""]
    for r in phase.results:
        lines += [f"### {r.name}: {r.status} in {r.seconds:.1f} s", ""]
        if r.command:
            lines += ["```", f"$ {r.shown or r.command}", *_tail(r.output, 40), "```", ""]
        elif r.note:
            lines += [r.note, ""]
    md.write_text("\n".join(lines))
    return md


def run_phase(run: Run, name: str, argv: Sequence[str]) -> tuple[bool, list[str]]:
    """Run one phase: whether every step passed, and its summary table."""
    log = run.out_dir / f"gpu_check-{run.date}-{name}.log"
    targets = SCRATCH / f"targets-{name}.jsonl"
    targets.unlink(missing_ok=True)
    log.write_text(f"tools/gpu_check {shlex.join(argv)}: phase {name}\n")
    phase = Phase(name, run.dry_run, run.budget_s, log, run.env(targets))
    kind = "CPU dry run" if run.dry_run else "GPU"
    print(f"== gpu_check {name} ({kind}); budget {run.budget_s:.0f} s; files in {run.out_dir}")
    counts = TestCounts() if name == "tests" else None
    steps = tests_phase(run, phase, counts) if counts is not None else bench_phase(run, phase)
    phase.run(steps)
    summary = summary_lines(phase, counts, read_targets(targets))
    md = write_markdown(run, phase, argv, summary, counts)
    with log.open("a") as f:
        f.write("\n" + "\n".join(summary) + "\n")
    print(f"wrote {md} and {log.name}", flush=True)
    return not any(r.bad for r in phase.results), summary


#: The phases ``tools/gpu_check`` runs, named on its command line.
PHASES = ("tests", "bench", "fetch-wheels")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="tools/gpu_check", description=(__doc__ or "").splitlines()[0]
    )
    # NOTE: no argparse choices= here: Python 3.11 checks an empty nargs="*" list against them
    # and refuses it ("invalid choice: []"); the phases are checked below instead.
    parser.add_argument(
        "phases",
        nargs="*",
        metavar="{" + ",".join(PHASES) + "}",
        help="what to run (default: tests then bench, each with its own budget)",
    )
    parser.add_argument("--cpu-dry-run", action="store_true", help="every step that needs no CUDA")
    parser.add_argument(
        "--out",
        type=Path,
        help="output folder (default: $OUT, else benchmarks/; dry run: build/gpu_check/dry-run/)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds per phase (default %(default)s)",
    )
    parser.add_argument(
        "--no-smokes",
        action="store_true",
        help="the tests phase runs no benchmark smokes (a bench call follows on the same machine)",
    )
    parser.add_argument(
        "--benches",
        default=",".join(b.name for b in BENCHES),
        help="comma-separated benchmarks to run, in this order (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    unknown_phases = [p for p in args.phases if p not in PHASES]
    if unknown_phases:
        parser.error(f"unknown phase(s) {unknown_phases}; choose from {list(PHASES)}")
    phases = args.phases or ["tests", "bench"]
    if "fetch-wheels" in phases:
        if len(phases) > 1 or args.cpu_dry_run:
            parser.error("fetch-wheels runs alone (on a machine with network)")
        return fetch_wheels()
    chosen = args.benches.split(",")
    unknown = set(chosen) - {b.name for b in BENCHES}
    if unknown:
        parser.error(
            f"unknown benchmark(s) {sorted(unknown)}; choose from {[b.name for b in BENCHES]}"
        )
    out_dir = args.out or (
        Path(os.environ["OUT"])
        if os.environ.get("OUT")
        else SCRATCH / "dry-run"
        if args.cpu_dry_run
        else ROOT / "benchmarks"
    )
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="gpu_check-site-"))
    run = Run(
        args.cpu_dry_run,
        out_dir,
        args.budget,
        tuple(next(b for b in BENCHES if b.name == name) for name in dict.fromkeys(chosen)),
        site,
    )
    run.smoke_in_bench = args.no_smokes or (args.cpu_dry_run and "bench" in phases)
    try:
        done = [run_phase(run, name, argv) for name in phases]
    finally:
        shutil.rmtree(site, ignore_errors=True)
    # NOTE: the tables last, all phases together: the device tool returns only the output's end.
    for _, summary in done:
        print("\n" + "\n".join(summary))
    return 0 if all(ok for ok, _ in done) else 1


if __name__ == "__main__":
    sys.exit(main())
