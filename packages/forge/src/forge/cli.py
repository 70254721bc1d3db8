"""The ``forge`` command line.

``forge build [CONFIG] [--nproc N] [--device cpu|cuda] [--set key=value ...]`` builds the mesh
and the parallel model, trains a few steps on synthetic tokens, checks parity against the
single-device model and prints a report. With no arguments it runs the embedded default: the
``debug`` model on 4 local CPU ranks as dp_shard 2 x tp 2 (sequence parallel, FSDP2 on dp).
Outside torchrun/SLURM it starts the local ranks itself (:mod:`forge.launch`); under
torchrun/SLURM it uses their ranks. ``forge train`` holds its ``training.out_dir`` and
``checkpoint.dir`` while any process of the run lives (:mod:`forge_checkpoint.lock`).

Exit status: 0 PASS, 1 FAIL (parity or a rank error), 2 bad config or arguments, 3 a damaged
checkpoint (train, export).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from .launch import Interrupted as _Interrupted
from .launch import RankFailed as _RankFailed
from .launch import failure_line as _failure_line  # noqa: F401 (its name before forge.launch)

# torch warns at import when NumPy is absent; forge does not use NumPy. Set before torch loads.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

__all__ = ["main"]


def _under_launcher() -> bool:
    """torchrun / SLURM-srun-with-torchrun set these for every rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def _prepare(args: argparse.Namespace, command: str) -> tuple[dict, int] | int:
    """Load and check the config before any rank starts: (config dict, nproc) or an exit status
    (2: config error, 3: damaged checkpoint).

    The checks on the config's values and paths, and the checkpoint a resume starts from, come
    before torch is imported (they take milliseconds, torch's import seconds); then the checks
    that import what the config names (a tp.plan module on a meta-device model, torchao), and
    for train the token file, read whole. Every problem of a phase is printed, one
    ``forge <command>: config error: ...`` line each.
    """
    from forge_checkpoint.files import CheckpointDamaged
    from forge_core.errors import ForgeConfigError

    from .checks import config_problems, import_problems, path_problems
    from .kinds import model_kind

    # NOTE: a plan module next to the config imports from the working directory, here and on
    # the ranks (_launch_local puts it on their PYTHONPATH): on the path before any check.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        cfg = _load(args)
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
        if command == "build":
            problems += model_kind(cfg).build_problems()
        problems += path_problems(cfg, command, rank_logs=not _under_launcher())
        if problems:
            return _refuse(command, problems)
        # NOTE: under torchrun every rank runs this; rank 0 alone reads the checkpoint, once
        # the process group exists (forge.train), instead of every rank reading all of it.
        if command == "train" and not _under_launcher():
            cfg = _checked_resume(cfg)
        problems = import_problems(cfg, world_size)
        if command == "train" and not problems:  # NOTE: reads the token file whole (torch)
            problems = model_kind(cfg).data_problems()
        if problems:
            return _refuse(command, problems)
    except CheckpointDamaged as e:
        print(f"forge {command}: damaged checkpoint: {e}", file=sys.stderr)
        return EXIT_DAMAGED
    except ForgeConfigError as e:
        return _refuse(command, [str(e)])
    return dataclasses.asdict(cfg), nproc


#: Module prefixes a plan may be imported from, granted by the person running forge (comma- or
#: ``os.pathsep``-separated), as ``--allow-import`` does.
ALLOW_IMPORT_ENV = "FORGE_ALLOW_IMPORT"


def granted_imports(args: argparse.Namespace) -> tuple[str, ...]:
    """The module prefixes the person grants: ``--allow-import`` and ``$FORGE_ALLOW_IMPORT``.

    NOTE: importing a module runs its code, so the grant comes from the command line or the
    environment, never from the config file that names the plan (``load_config`` refuses
    ``tp.allow_import`` in a file): a downloaded config cannot grant itself an import.
    """
    from_env = re.split(rf"[,{re.escape(os.pathsep)}]", os.environ.get(ALLOW_IMPORT_ENV, ""))
    names = [n.strip() for n in [*getattr(args, "allow_import", []), *from_env]]
    return tuple(dict.fromkeys(n for n in names if n))


def _load(args: argparse.Namespace) -> Any:
    """``args.config`` with the ``--set`` overrides and the granted imports
    (:func:`granted_imports`) added to ``tp.allow_import``."""
    from .config import load_config

    cfg = load_config(args.config, args.set)
    granted = granted_imports(args)
    if not granted:
        return cfg
    allow = tuple(dict.fromkeys((*cfg.tp.allow_import, *granted)))
    return dataclasses.replace(cfg, tp=dataclasses.replace(cfg.tp, allow_import=allow))


def _refuse(command: str, problems: Sequence[str]) -> int:
    """Print each problem as ``forge <command>: config error: <problem>``; EXIT_CONFIG."""
    for problem in problems:
        print(f"forge {command}: config error: {problem}", file=sys.stderr)
    return EXIT_CONFIG


#: Exit status of forge's commands (README "Failures and recovery").
EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_DAMAGED = 0, 1, 2, 3


def _checked_resume(cfg: Any) -> Any:
    """Check ``checkpoint.dir`` and pick and verify the checkpoint ``forge train`` resumes
    from, before any rank starts (:func:`forge.resume.resume_point`; with ``resume = "none"``
    only the directory: a ``step-N`` forge did not write is refused, never overwritten), and
    pass it to the ranks as a path they need not verify again. Raises CheckpointDamaged /
    ForgeConfigError."""
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
        except _Interrupted as e:
            print(f"forge build: stopped by {e}", file=sys.stderr)
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
    from forge_checkpoint.files import CheckpointDamaged, find_latest
    from forge_core.errors import ForgeConfigError

    cfg_dict, nproc = prepared
    try:
        summary = _locked_train(cfg_dict, args.device, nproc)
    except CheckpointDamaged as e:  # under torchrun: rank 0 verified it, every rank says so
        print(f"forge train: damaged checkpoint: {e}", file=sys.stderr)
        return EXIT_DAMAGED
    except ForgeConfigError as e:  # a bad config, or a directory another run holds
        print(f"forge train: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except _Interrupted as e:
        # The launcher got the signal and passed it to the ranks, but not every rank finished
        # (one was still starting, or failed while stopping): whatever was saved is intact.
        latest = find_latest(_run_dirs(cfg_dict)["checkpoint.dir"])
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
    if not summary.text:
        return EXIT_OK  # a rank other than 0 under torchrun: rank 0 reports
    print(summary.text)
    return _stopped(summary) if summary.stopped_by else EXIT_OK


def _run_dirs(cfg_dict: dict) -> dict[str, Path]:
    """The directories one run holds: ``training.out_dir`` and ``checkpoint.dir`` (by default
    inside it). Two runs writing one would interleave their metrics and logs, or resume from
    each other's steps."""
    from .config import load_config

    cfg = load_config(cfg_dict)
    return {"training.out_dir": Path(cfg.training.out_dir), "checkpoint.dir": cfg.checkpoint_dir}


def _locked_train(cfg_dict: dict, device: str, nproc: int) -> Any:
    """Train while holding the run's directories (:mod:`forge_checkpoint.lock`): forge's
    launcher owns them and each rank it starts holds them too (:func:`_train_rank`), so they
    stay locked while any process of the run lives. Under torchrun rank 0 owns them and every
    rank holds them. Rank 0's summary (under torchrun: this rank's)."""
    from forge_checkpoint.lock import run_lock

    dirs = _run_dirs(cfg_dict)
    if not _under_launcher():
        with run_lock(dirs):
            return _launch_local(
                _train_rank,
                cfg_dict,
                device,
                nproc,
                _log_dir(cfg_dict),
                preload="forge.train",  # _train_rank imports it in the rank
            )
    # NOTE: torchrun starts every rank at once, so rank 0 cannot tell an earlier run's
    # surviving ranks from its own siblings holding the ranks' lock: it checks only the owner.
    owner = os.environ.get("RANK") == "0"
    with run_lock(dirs, check_ranks=False) if owner else contextlib.nullcontext():
        return _train_rank(cfg_dict, device)


def _train_rank(cfg_dict: dict, device: str) -> Any:
    """``run_train`` on one rank, holding the run's directories while it runs
    (:func:`forge_checkpoint.lock.rank_lock`).

    A write that fails on a full disk becomes ``OSError(ENOSPC)`` naming the full directory:
    torch's writers report it as a short write ("unexpected pos"), Python's without a path.
    """
    from forge_checkpoint.lock import rank_lock

    # NOTE: imported here: forge's own launcher only starts ranks, which import it in their
    # forkserver (seconds of torch imports the launcher need not pay).
    from .train import run_train

    dirs = _run_dirs(cfg_dict)
    with rank_lock(dirs.values()):
        try:
            return run_train(cfg_dict, device)
        except (OSError, RuntimeError) as e:
            full = [p for p in (dirs["checkpoint.dir"], dirs["training.out_dir"]) if _full(p)]
            if not full:
                raise
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(full[0])) from e


def _full(path: Path) -> bool:
    """Whether the file system holding ``path`` has no space left: under 64 KiB that this user
    may write (root may write the blocks reserved for it). A write that failed for want of
    space has filled it to the last block."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return free * st.f_frsize < 64 << 10


def _stopped(summary: Any) -> int:
    """The status line of a run that a signal stopped (SIGTERM, Ctrl-C, to the launcher or to
    any rank): EXIT_OK once its checkpoint is saved."""
    step = summary.steps[-1].step if summary.steps else summary.start_step
    latest = summary.last_checkpoint or summary.resumed_from
    print(
        f"forge train: stopped by {summary.stopped_by} after step {step}; "
        + (
            f"checkpoint {latest} (resume: run the same command again)"
            if latest
            else "no checkpoint was saved"
        ),
        file=sys.stderr,
    )
    return EXIT_OK if latest else EXIT_FAILED


def _plan(args: argparse.Namespace) -> int:
    from forge_core.errors import ForgeConfigError

    try:  # NOTE: a config that does not load is one line before torch's import
        cfg = _load(args)
    except ForgeConfigError as err:
        print(f"forge plan: config error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    from .plan_cli import run_plan_command

    return run_plan_command(cfg, args)


def _export(args: argparse.Namespace) -> int:
    from forge_checkpoint.files import CheckpointDamaged, read_train_state, verify_checkpoint
    from forge_core.errors import ForgeConfigError

    from .export import check_export_out

    try:
        # NOTE: before torch's import and before the checkpoint is read, so a bad --out or a
        # damaged file is one line at once
        check_export_out(args.checkpoint, args.out, args.format, name="--out")
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
    except OSError as e:  # NOTE: --out was writable when checked; the disk may fill since
        print(f"forge export: could not write --out {args.out!r}: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(f"forge export: wrote {written}")
    return EXIT_OK


def _log_dir(cfg_dict: dict) -> Path:
    """Where the ranks other than 0 write their output: ``<training.out_dir>/logs``."""
    return Path(cfg_dict["training"]["out_dir"]) / "logs"


def _launch_local(
    fn: Callable[[dict, str], Any],
    cfg_dict: dict,
    device: str,
    nproc: int,
    log_dir: Path,
    *,
    preload: str,
) -> Any:
    """Start ``nproc`` local ranks running ``fn(cfg_dict, device)``; returns rank 0's result
    (:func:`forge.launch.launch_local`: raises ``_RankFailed`` with one line, or
    ``_Interrupted`` after a signal the ranks did not all survive)."""
    from .launch import launch_local

    return launch_local(fn, cfg_dict, device, nproc, log_dir, preload=preload)


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
    parser.add_argument(
        "--allow-import",
        action="append",
        default=[],
        metavar="MODULE",
        help="let tp.plan / vlm.encoder_tp_plan import from this module prefix (importing runs "
        f"its code; a config file cannot grant it); also ${ALLOW_IMPORT_ENV}=mod1,mod2",
    )


def _launched(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to start (default: 4 on cpu, all GPUs on cuda); ignored under torchrun",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")


def _notices_on_one_line() -> None:
    """Show each :class:`~forge.config.ForgeConfigNotice` (a config written the old way, still
    read) as one ``forge: notice: ...`` line on stderr; other warnings as Python shows them."""
    from .config import ForgeConfigNotice

    show = warnings.showwarning

    def one_line(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if issubclass(category, ForgeConfigNotice):
            print(f"forge: notice: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = one_line


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
    from .plan_cli import add_plan_arguments

    add_plan_arguments(plan)
    export = sub.add_parser(
        "export",
        help="write a checkpoint's model as one safetensors file or a Hugging Face folder",
    )
    export.add_argument("checkpoint", help="a step-N directory written by forge train")
    export.add_argument(
        "--out",
        required=True,
        help="output .safetensors file (or folder for --format hf): a new path, or an earlier "
        "forge export; a file forge did not write is never overwritten",
    )
    export.add_argument("--format", choices=("safetensors", "hf"), default="safetensors")
    from .plot import add_plot_parser, run_plot

    add_plot_parser(sub)
    args = parser.parse_args(argv)
    if getattr(args, "nproc", None) is not None and args.nproc < 1:
        parser.error("--nproc must be >= 1")
    if args.command == "plan" and args.world_size < 1:
        parser.error("--world-size must be >= 1")
    _notices_on_one_line()
    commands = {"build": _build, "train": _train, "plan": _plan, "export": _export}
    return {**commands, "plot": run_plot}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
