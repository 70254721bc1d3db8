"""The ``forge`` command line.

``forge build [CONFIG] [--nproc N] [--device cpu|cuda] [--set key=value ...]`` builds the mesh
and the parallel model, trains a few steps on synthetic tokens, checks parity against the
single-device model and prints a report. With no arguments it runs the embedded default: the
``debug`` model on 4 local CPU ranks as dp_shard 2 x tp 2 (sequence parallel, FSDP2 on dp). Outside torchrun/SLURM it starts the local
ranks itself through torch's elastic launcher; under torchrun/SLURM it uses their ranks.

Exit status: 0 PASS, 1 FAIL (parity or a rank error), 2 bad config or arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Sequence

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


def _build(args: argparse.Namespace) -> int:
    from forge_core import ForgeConfigError, load_config

    from .job import check_config, run_build

    try:
        cfg = load_config(args.config, args.set)
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ForgeConfigError(
                    "--device cuda but no CUDA device is visible; use --device cpu"
                )
        nproc = args.nproc
        if nproc is None:
            import torch

            nproc = torch.cuda.device_count() if args.device == "cuda" else 4
        world_size = int(os.environ["WORLD_SIZE"]) if _under_launcher() else nproc
        check_config(cfg, world_size)
    except ForgeConfigError as e:
        print(f"forge build: config error: {e}", file=sys.stderr)
        return 2
    cfg_dict = dataclasses.asdict(cfg)
    start = time.perf_counter()
    if _under_launcher():
        report = run_build(cfg_dict, args.device)
        if report.text:
            print(report.text + f"\n(total wall time {time.perf_counter() - start:.1f}s)")
        return 0 if report.passed else 1
    return _launch_local(cfg_dict, args.device, nproc, start)


def _launch_local(cfg_dict: dict, device: str, nproc: int, start: float) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .job import run_build

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    if device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Ranks are fresh interpreters: give them the working directory on the import path, as the
    # parent has, so a tp.plan module next to the config imports there too.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])
    )
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"forge-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        results = elastic_launch(config, run_build)(cfg_dict, device)
    except ChildFailedError as e:
        print(f"forge build: FAIL: a rank failed:\n{e}", file=sys.stderr)
        return 1
    report = results[0]
    print(
        report.text
        + f"\n(total wall time with {nproc} rank launch: {time.perf_counter() - start:.1f}s)"
    )
    return 0 if report.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="forge", description="forge: make a PyTorch model parallel."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser(
        "build", help="build the parallel model, train a few steps, check parity, report"
    )
    build.add_argument(
        "config",
        nargs="?",
        default=None,
        help="TOML config ([model], [parallelism], [tp], [training]); default: embedded debug config",
    )
    build.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to start (default: 4 on cpu, all GPUs on cuda); ignored under torchrun",
    )
    build.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    build.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set parallelism.dp_replicate=2",
    )
    args = parser.parse_args(argv)
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be >= 1")
    return _build(args)


if __name__ == "__main__":
    sys.exit(main())
