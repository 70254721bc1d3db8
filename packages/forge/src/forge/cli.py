"""The ``forge`` command line.

``forge build [CONFIG] [--nproc N] [--device cpu|cuda] [--set key=value ...]`` builds the mesh
and the parallel model, trains a few steps on synthetic tokens, checks parity against the
single-device model and prints a report. With no arguments it runs the embedded default: the
``debug`` model on 4 local CPU ranks as dp_shard 2 x tp 2 (sequence parallel, FSDP2 on dp). Outside torchrun/SLURM it starts the local
ranks itself through torch's elastic launcher; under torchrun/SLURM it uses their ranks.

Exit status: 0 PASS, 1 FAIL (parity or a rank error), 2 bad config or arguments, 3 a damaged
checkpoint (train, export).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import re
import signal
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# torch warns at import when NumPy is absent; forge does not use NumPy. Set before torch loads.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _under_launcher() -> bool:
    """torchrun / SLURM-srun-with-torchrun set these for every rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def _prepare(args: argparse.Namespace, command: str) -> tuple[dict, int] | int:
    """Load and check the config before any rank starts: (config dict, nproc) or an exit status
    (2: config error, 3: damaged checkpoint).

    The checks on the config's values, and the checkpoint a resume starts from, come before
    torch is imported (they take milliseconds, torch's import seconds); then the checks that
    import what the config names (a tp.plan module on a meta-device model, torchao). Every
    problem of a phase is printed, one ``forge <command>: config error: ...`` line each.
    """
    from forge_checkpoint.files import CheckpointDamaged
    from forge_core.errors import ForgeConfigError

    from .checks import config_problems, import_problems
    from .config import load_config

    try:
        cfg = load_config(args.config, args.set)
        nproc = args.nproc
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ForgeConfigError(
                    "--device cuda but no CUDA device is visible; use --device cpu"
                )
            nproc = torch.cuda.device_count() if nproc is None else nproc
        nproc = 4 if nproc is None else nproc
        world_size = int(os.environ["WORLD_SIZE"]) if _under_launcher() else nproc
        problems = config_problems(cfg, world_size)
        if command == "build" and cfg.is_field:
            problems.append(
                "forge build checks token models against one device; a field model "
                "(model.preset=debug_field) trains with forge train (its parity is in the tests)"
            )
        if command == "train" and cfg.data.path is not None and not os.path.isfile(cfg.data.path):
            problems.append(f"data.path={cfg.data.path!r} does not exist or is not a file")
        if problems:
            return _refuse(command, problems)
        # NOTE: under torchrun every rank runs this; rank 0 alone reads the checkpoint, once
        # the process group exists (forge.train), instead of every rank reading all of it.
        if command == "train" and cfg.checkpoint.resume != "none" and not _under_launcher():
            cfg = _checked_resume(cfg)
        # NOTE: the ranks import tp.plan with the working directory on their path
        # (_launch_local); the checks here import it the same way.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        problems = import_problems(cfg, world_size)
        if problems:
            return _refuse(command, problems)
    except CheckpointDamaged as e:
        print(f"forge {command}: damaged checkpoint: {e}", file=sys.stderr)
        return EXIT_DAMAGED
    except ForgeConfigError as e:
        return _refuse(command, [str(e)])
    return dataclasses.asdict(cfg), nproc


def _refuse(command: str, problems: Sequence[str]) -> int:
    """Print each problem as ``forge <command>: config error: <problem>``; EXIT_CONFIG."""
    for problem in problems:
        print(f"forge {command}: config error: {problem}", file=sys.stderr)
    return EXIT_CONFIG


#: Exit status of forge's commands (README "Failures and recovery").
EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_DAMAGED = 0, 1, 2, 3


def _checked_resume(cfg: Any) -> Any:
    """Pick and verify the checkpoint ``forge train`` resumes from, before any rank starts
    (:func:`forge.resume.resume_point`), and pass it to the ranks as a path they need
    not verify again. Raises CheckpointDamaged / ForgeConfigError."""
    from .resume import resume_point

    chosen, skipped = resume_point(cfg)
    for line in skipped:
        print(f"forge train: skipping damaged checkpoint {line}", file=sys.stderr)
    if chosen is None:
        return cfg  # nothing saved yet: a fresh start
    if cfg.checkpoint.resume == "latest":
        print(f"forge train: resuming from {chosen}", file=sys.stderr)
    return dataclasses.replace(
        cfg,
        checkpoint=dataclasses.replace(cfg.checkpoint, resume=str(chosen), verify=False),
    )


def _build(args: argparse.Namespace) -> int:
    prepared = _prepare(args, "build")
    if isinstance(prepared, int):
        return prepared
    from .job import run_build

    cfg_dict, nproc = prepared
    start = time.perf_counter()
    if _under_launcher():
        report = run_build(cfg_dict, args.device)
    else:
        try:
            report = _launch_local(
                run_build, cfg_dict, args.device, nproc, _log_dir(cfg_dict), preload="forge.job"
            )
        except _RankFailed as e:
            print(f"forge build: FAIL: {e}", file=sys.stderr)
            return EXIT_FAILED
    if report.text:
        print(
            report.text
            + f"\n(total wall time with {nproc} rank(s): {time.perf_counter() - start:.1f}s)"
        )
    return EXIT_OK if report.passed else EXIT_FAILED


def _train(args: argparse.Namespace) -> int:
    prepared = _prepare(args, "train")
    if isinstance(prepared, int):
        return prepared
    from forge_checkpoint.files import CheckpointDamaged, checkpoint_lock, find_latest
    from forge_core.errors import ForgeConfigError

    from .config import load_config

    cfg_dict, nproc = prepared
    # NOTE: the launcher (or torchrun's rank 0) holds the checkpoint directory for the run.
    owner = not _under_launcher() or os.environ.get("RANK") == "0"
    ckpt_dir = load_config(cfg_dict).checkpoint_dir
    try:
        with checkpoint_lock(ckpt_dir) if owner else contextlib.nullcontext():
            if _under_launcher():
                # NOTE: imported here: forge's own launcher only starts ranks, which import it
                # in their forkserver (seconds of torch imports the launcher need not pay).
                from .train import run_train

                summary = run_train(cfg_dict, args.device)
            else:
                summary = _launch_local(
                    _train_rank,
                    cfg_dict,
                    args.device,
                    nproc,
                    _log_dir(cfg_dict),
                    preload="forge.train",  # _train_rank imports it in the rank
                )
    except CheckpointDamaged as e:  # under torchrun: rank 0 verified it, every rank says so
        print(f"forge train: damaged checkpoint: {e}", file=sys.stderr)
        return EXIT_DAMAGED
    except ForgeConfigError as e:
        print(f"forge train: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except _Interrupted as e:
        # The launcher got the signal and passed it to the ranks, which finished their step and
        # saved before exiting; their return values are lost with the launcher's exception.
        latest = find_latest(load_config(cfg_dict).checkpoint_dir)
        print(
            f"forge train: stopped by {e}; "
            + (
                f"latest checkpoint {latest} (resume: run the same command again)"
                if latest
                else "no checkpoint was saved"
            ),
            file=sys.stderr,
        )
        return EXIT_OK if latest else EXIT_FAILED
    except _RankFailed as e:
        print(f"forge train: FAIL: {e}", file=sys.stderr)
        return EXIT_FAILED
    if summary.text:
        print(summary.text)
    return EXIT_OK


def _train_rank(cfg_dict: dict, device: str) -> Any:
    """``run_train`` on one rank started by forge's launcher."""
    import threading

    from .train import run_train

    summary = run_train(cfg_dict, device)
    if summary.stopped_by:
        # NOTE: after a signal the launcher may itself be shutting down: it then never collects
        # this return value, and the rank would wait for it until the launcher's kill timeout.
        # The checkpoint is already on disk, so leave on our own if nobody collects it within 2 s
        # (a launcher that is still running collects within its 0.1 s monitor interval).
        timer = threading.Timer(2.0, os._exit, (0,))
        timer.daemon = True  # when the launcher does collect it, exit at once as usual
        timer.start()
    return summary


def _plan(args: argparse.Namespace) -> int:
    from forge_core.errors import ForgeConfigError

    from .config import load_config

    try:  # NOTE: a config that does not load is one line before torch's import
        cfg = load_config(args.config, args.set)
    except ForgeConfigError as err:
        print(f"forge plan: config error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    from .plan import run_plan

    return run_plan(cfg, args.world_size)


def _export(args: argparse.Namespace) -> int:
    from forge_checkpoint.files import CheckpointDamaged, read_train_state, verify_checkpoint
    from forge_core.errors import ForgeConfigError

    try:
        # NOTE: before torch's import, so a damaged file is one line at once
        read_train_state(args.checkpoint)
        verify_checkpoint(args.checkpoint)
        from .export import export_checkpoint

        written = export_checkpoint(args.checkpoint, args.out, layout=args.format, verify=False)
    except CheckpointDamaged as e:
        print(f"forge export: damaged checkpoint: {e}", file=sys.stderr)
        return EXIT_DAMAGED
    except ForgeConfigError as e:
        print(f"forge export: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"forge export: wrote {written}")
    return EXIT_OK


def _log_dir(cfg_dict: dict) -> Path:
    """Where the ranks other than 0 write their output: ``<training.out_dir>/logs``."""
    return Path(cfg_dict["training"]["out_dir"]) / "logs"


class _RankFailed(RuntimeError):
    pass


class _Interrupted(RuntimeError):
    pass


#: Errors a rank raises because another rank died (its socket closed): never the cause.
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|remote worker|Broken pipe", re.I)


def _one_line(text: str) -> str:
    """A rank's error message on one line (an embedded traceback: its first and last lines)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and any(line.startswith("Traceback") for line in lines):
        return f"{lines[0]} ... {lines[-1]}"
    return " ".join(lines)


def _failure_line(failures: dict[int, Any], log_root: Path, run_id: str = "*") -> str:
    """One line for a failed launch: the rank whose failure caused it, its exit code or signal,
    its message, and where its full output is (``failures``: ChildFailedError.failures; the
    launch's logs are under ``log_root/<run_id>_*``).

    The cause: a rank killed by a signal, else a rank whose error is not a lost connection to a
    dead peer, else the earliest failure.
    """

    def message(failure: Any) -> str:
        text = failure.message
        return _one_line(text.get("message", "") if isinstance(text, dict) else str(text))

    rank, first = min(
        failures.items(),
        key=lambda kv: (
            kv[1].exitcode >= 0,
            bool(_PEER_LOST.search(message(kv[1]))),
            kv[1].timestamp,
            kv[0],
        ),
    )
    if first.exitcode < 0:
        what = f"rank {rank} was killed by {first.signal_name()}"
    else:
        text = message(first)
        what = f"rank {rank} exited with code {first.exitcode}" + (f": {text}" if text else "")
    logs = sorted(log_root.glob(f"{run_id}_*/attempt_*/{rank}/stderr.log"))
    if logs:
        where = f"its log: {logs[-1]}"
    elif first.error_file and Path(first.error_file).is_file():
        where = f"its traceback: {first.error_file}"
    else:
        where = "its output is above"
    others = f"; {len(failures) - 1} other rank(s) stopped after it" if len(failures) > 1 else ""
    return f"{what} ({where}{others})"


def _rank_main(fn: Callable[[dict, str], Any], cfg_dict: dict, device: str) -> Any:
    """One rank started by :func:`_launch_local`: ``fn(cfg_dict, device)``.

    NOTE: when a rank dies (killed, out of memory) the others fail at once with a lost
    connection, and the launcher reports whichever exit it sees first. A rank whose error is
    such a lost connection waits a moment before exiting, so the launcher sees the rank that
    died first and :func:`_failure_line` names the cause, not its echo.
    """
    try:
        return fn(cfg_dict, device)
    except Exception as e:
        if _PEER_LOST.search(str(e)):
            time.sleep(2.0)  # the launcher stops this rank sooner once it sees the dead one
        raise


def _launch_local(
    fn: Callable[[dict, str], Any],
    cfg_dict: dict,
    device: str,
    nproc: int,
    log_dir: Path,
    *,
    preload: str,
) -> Any:
    """Start ``nproc`` local ranks running ``fn(cfg_dict, device)``; returns rank 0's result.

    ``preload``: the module that runs the job, imported once in the ranks' forkserver.

    Rank 0 keeps this terminal (progress, report); the other ranks' output goes to
    ``log_dir/<run id>/attempt_0/<rank>/{stdout,stderr}.log``. A failed rank becomes one line
    (:func:`_failure_line`) instead of the launcher's tracebacks.
    """
    from forge_core.torch_compat import launch_config
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # NOTE: the launcher logs each failure with its traceback (ERROR) and each rank it stops
    # (WARNING); forge prints its own line instead.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    if device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Ranks are fresh interpreters: give them the working directory on the import path, as the
    # parent has, so a tp.plan module next to the config imports there too.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])
    )
    # NOTE: ranks fork from a forkserver that has imported torch and forge once, instead of
    # each importing them (seconds per rank, serialized on few cores); the forkserver is a
    # clean single-threaded process that has not touched CUDA. The module that runs the job
    # (forge.train, forge.job: DTensor, FSDP2, DCP) is preloaded there, next to fn's module.
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", fn.__module__, preload])
    run_id = f"forge-{uuid.uuid4().hex[:8]}"
    config = launch_config(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver",
        # NOTE: on SIGTERM / Ctrl-C the launcher passes the signal to the ranks and kills them
        # after this many seconds: the time forge train has to finish its step and save
        # (torch 2.11: a fixed 30 s, see launch_config).
        shutdown_timeout=300,
        logs_specs=DefaultLogsSpecs(
            log_dir=str(log_dir), redirects={r: Std.ALL for r in range(1, nproc)}, tee={}
        ),
    )
    try:
        results = elastic_launch(config, _rank_main)(fn, cfg_dict, device)
    except ChildFailedError as e:
        raise _RankFailed(_failure_line(e.failures, log_dir, run_id)) from None
    except SignalException as e:
        raise _Interrupted(signal.Signals(e.sigval).name) from None
    return results[0]


def _common(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        default=None,
        help=f"TOML config ([model], [parallelism], [tp], [training], ...); default: {what}",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set parallelism.dp_replicate=2",
    )


def _launched(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to start (default: 4 on cpu, all GPUs on cuda); ignored under torchrun",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="forge", description="forge: make a PyTorch model parallel."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser(
        "build", help="build the parallel model, train a few steps, check parity, report"
    )
    _common(build, "embedded debug config (dp_shard 2 x tp 2)")
    _launched(build)
    train = sub.add_parser(
        "train",
        help="train with checkpoints, a progress bar and a metrics file; resumes from the latest checkpoint",
    )
    _common(train, "embedded debug config")
    _launched(train)
    plan = sub.add_parser(
        "plan",
        help="lay a config out over N ranks in one process (fake backend, meta tensors): memory and collectives per rank",
    )
    _common(plan, "embedded debug config")
    plan.add_argument("--world-size", type=int, required=True, help="ranks to plan for")
    export = sub.add_parser(
        "export",
        help="write a checkpoint's model as one safetensors file or a Hugging Face Llama folder",
    )
    export.add_argument("checkpoint", help="a step-N directory written by forge train")
    export.add_argument(
        "--out", required=True, help="output .safetensors file (or folder for --format hf)"
    )
    export.add_argument("--format", choices=("safetensors", "hf"), default="safetensors")
    args = parser.parse_args(argv)
    if getattr(args, "nproc", None) is not None and args.nproc < 1:
        parser.error("--nproc must be >= 1")
    if args.command == "plan" and args.world_size < 1:
        parser.error("--world-size must be >= 1")
    return {"build": _build, "train": _train, "plan": _plan, "export": _export}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
