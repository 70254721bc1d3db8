"""What ``forge train`` shows while it runs, and how it stops on a signal.

Provides:

- :func:`train_flops_per_token`, :func:`peak_flops`, :data:`PEAK_BF16_FLOPS`: the FLOP counts
  behind the MFU estimate of each logged step;
- :func:`peak_memory`, :func:`format_memory`: each rank's peak memory and its one-line form;
- :class:`StopFlag`: SIGTERM / Ctrl-C noted instead of dying, so the ranks agree to stop after
  the current step and save;
- :class:`Progress`: rank 0's display, a tqdm bar on a terminal and plain lines otherwise.

Split from :mod:`forge.train` (the loop itself) so that each reads in one sitting.
"""

from __future__ import annotations

import resource
import shutil
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from forge_moe_ep.costs import active_params

from .config import ForgeConfig

__all__ = [
    "PEAK_BF16_FLOPS",
    "Progress",
    "StopFlag",
    "format_memory",
    "peak_flops",
    "peak_memory",
    "train_flops_per_token",
]


#: Dense bf16 tensor-core peak (FLOP/s) of GPUs forge knows, for the MFU estimate.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def train_flops_per_token(cfg: ForgeConfig) -> float:
    """Training FLOPs per token: 6 x active parameters + causal attention scores (12 L S d / 2)."""
    m, s = cfg.decoder, cfg.training.seq_len
    return 6.0 * active_params(m) + 6.0 * m.n_layers * s * m.dim


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None when unknown (CPU, an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class StopFlag:
    """Notes SIGTERM / SIGINT instead of dying; the loop stops after the step it is in, on
    every rank: each step's all-gather carries every rank's :attr:`signum` (its vote)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.signum = 0  # 0: no signal

    def __call__(self, signum: int, frame: object) -> None:
        # NOTE: forge's launcher passes a signal it gets on to the ranks, and Ctrl-C also
        # reaches them from the terminal, so a rank may see one twice; stopping is already under
        # way (the launcher kills after its shutdown grace, or at a second signal of its own).
        # Only Ctrl-C (SIGINT: someone is watching) is acknowledged at once; SIGTERM (SLURM
        # preemption, a scheduler) quietly. A signal that stops the run is named in the final
        # report and the launcher's status line ("stopped by SIGTERM", "... on rank 1").
        if self.signal is None:
            self.signal, self.signum = signal.Signals(signum).name, signum
            if signum != signal.SIGINT:
                return
            print(
                f"[rank {dist.get_rank()}] {self.signal}: finishing this step, then saving",
                file=sys.stderr,
                flush=True,
            )

    def stopped_by(self, votes: list[int]) -> str:
        """What stopped the run, given every rank's vote: this rank's signal, else the first
        rank's that got one (``"SIGTERM on rank 1"``)."""
        if self.signal is not None:
            return self.signal
        rank, signum = next((r, v) for r, v in enumerate(votes) if v)
        return f"{signal.Signals(signum).name} on rank {rank}"

    @contextmanager
    def installed(self) -> Iterator[StopFlag]:
        previous = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class Progress:
    """Rank 0's display: a tqdm bar updated in place on a TTY, plain lines otherwise."""

    def __init__(self, total: int, start: int, every: int) -> None:
        self.every, self.bar = every, None
        if sys.stderr.isatty():
            from tqdm import tqdm

            # NOTE: a terminal reporting a 0 x 0 size (a bare pty, some CI runners) makes tqdm
            # draw nothing; shutil falls back to 120 x 24 for a zero dimension.
            size = shutil.get_terminal_size((120, 24))
            self.bar = tqdm(
                total=total,
                initial=start,
                desc="forge train",
                ncols=size.columns,
                nrows=size.lines,
                mininterval=0,  # redraw every step
                file=sys.stderr,
                # a short bar leaves the line's width to the numbers
                bar_format="{desc} {percentage:3.0f}%|{bar:10}| {n}/{total} [{elapsed}<{remaining}] {postfix}",
            )

    def update(self, text: str, step: int, total: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == total:
            print(f"step {step}/{total}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_memory(per_rank: list[int]) -> str:
    """Peak memory of every rank (up to 8; then the extremes), in GiB."""
    gib = [b / 2**30 for b in per_rank]
    if len(gib) <= 8:
        return "mem " + "|".join(f"{g:.2f}" for g in gib) + " GiB"
    top = gib.index(max(gib))
    return f"mem max {max(gib):.2f} GiB (r{top}) min {min(gib):.2f} GiB"
