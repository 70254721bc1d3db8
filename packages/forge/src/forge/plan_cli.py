"""``forge plan``'s command line: its options and the call they make (``forge.cli`` adds the
config and ``--set`` arguments every command shares). Imports nothing heavy at import time: a
config that does not load is reported before torch is imported."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_plan_arguments", "run_plan_command"]


def add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    """The options of ``forge plan`` beyond the config and ``--set``."""
    plan.add_argument("--world-size", type=int, required=True, help="ranks to plan for")
    plan.add_argument(
        "--gpu",
        help="a GPU profile (h100-sxm, h200, b200, a100-80gb) or a profile file NAME.toml with "
        "the same fields: memory verdict and step time",
    )
    plan.add_argument("--format", choices=("text", "json"), default="text")
    plan.add_argument(
        "--search", action="store_true", help="rank the layouts that fit by predicted tokens/s"
    )
    plan.add_argument(
        "--moe-skew",
        type=float,
        default=1.0,
        metavar="F",
        help="MoE with expert parallelism: the busiest rank's experts get F x the balanced "
        "routed rows (default 1: balanced)",
    )


def run_plan_command(cfg: Any, args: argparse.Namespace) -> int:
    """``forge plan`` on a loaded config: the search or the config's own layout."""
    options = {"gpu": args.gpu, "output": args.format, "moe_skew": args.moe_skew}
    if args.search:
        from .plan_search import run_search

        return run_search(cfg, args.world_size, **options)
    from .plan import run_plan

    return run_plan(cfg, args.world_size, **options)
