"""The ``forge train`` job: train a model with any layout, log, checkpoint, stop cleanly.

Runs on every rank (forge's own launcher, torchrun or SLURM). One optimizer step:

- this rank's data-parallel slice of the step's global batch (``forge.data``), split into
  ``grad_accum`` micro-batches; gradients are synchronized on the last one only. Under pipeline
  parallelism (``parallelism.pp > 1``) the model is this rank's share of the stages and the
  schedule splits the slice into ``pp.microbatches`` instead (``grad_accum`` is 1): the same
  ``forward_backward`` runs it, and the checkpoints keep the unsplit parameter names;
- the loss is token-weighted over the whole global batch: each rank backpropagates
  ``sum of its token losses x dp_degree / tokens in the global batch``, so after FSDP2/DDP
  average the gradients over the data-parallel ranks the result is the gradient of the mean
  over every target token of the step, however unevenly ignored targets (image placeholders)
  fall on the ranks. The token count is all-reduced on the device (no host wait);
- the global gradient norm over every mesh (TP, FSDP2, EP experts, every pipeline stage),
  clipped to ``training.max_grad_norm``; AdamW; warmup + cosine LR;
- rank 0 logs step, loss, grad norm, LR, tokens/s, each rank's peak memory (and MFU on a GPU)
  to a progress bar (a TTY) or plain lines, and appends the same to ``<out_dir>/metrics.jsonl``;
- checkpoints every ``checkpoint.every`` steps and at the end (:mod:`forge_checkpoint.dcp`).

SIGTERM (SLURM preemption) or Ctrl-C: the rank notes it, the ranks agree after the current step
(a one-integer all-reduce on a gloo group), save a checkpoint and return normally. The next
``forge train`` with the same config resumes from it (``checkpoint.resume = "latest"``).
"""

from __future__ import annotations

import math
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_checkpoint.dcp import Checkpointer, CheckpointIOError, count_nonfinite
from forge_checkpoint.files import CheckpointDamaged
from forge_core import (
    ForgeConfigError,
    attach_optimizer_hooks,
)
from forge_core.mesh_dims import dp_rank_and_size
from forge_core.stages import unwrap
from forge_mesh import mesh_layout
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from .build import ParallelPlan, model_from_config
from .config import ForgeConfig, load_config
from .job import setup_rank, tp_description
from .kinds import model_kind
from .optim import adamw, clip_grad_norm_, warmup_cosine
from .profiling import StepProfiler
from .resume import resume_point
from .run_log import RunLog, StepLog
from .train_console import (
    StopFlag,
    peak_flops,
    peak_memory,
    train_flops_per_token,
)
from .validation import validation_loss

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .data import Batch, StepData

__all__ = ["StepLog", "TrainSummary", "peak_flops", "run_train", "train_flops_per_token"]


@dataclass
class TrainSummary:
    """What rank 0 reports back: the steps it ran, where it saved, why it stopped."""

    steps: list[StepLog] = field(default_factory=list)
    #: the Hugging Face directories written after checkpoints (``checkpoint.export_hf``)
    hf_exports: list[str] = field(default_factory=list)
    #: ``(step, validation loss)`` after every ``metrics.validation_every`` steps
    validation: list[tuple[int, float]] = field(default_factory=list)
    start_step: int = 0
    resumed_from: str | None = None
    last_checkpoint: str | None = None
    stopped_by: str | None = None  # the signal's name when SIGTERM / Ctrl-C ended the run
    text: str = ""


def _nonfinite_values(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """How many NaN/inf values this rank holds in what a checkpoint saves of the model
    (parameters, persistent buffers) and the optimizer state. ``Checkpointer.save`` runs the
    same count (:func:`forge_checkpoint.dcp.count_nonfinite`) and refuses to save any."""
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer)["state"],
    }
    return count_nonfinite(state)[0]


@contextmanager
def _published_before_failure(checkpointer: Checkpointer, summary: TrainSummary) -> Iterator[None]:
    """On a diverged run (``FloatingPointError``: a non-finite loss or gradient norm, or state
    a save refused), publish the asynchronous save still pending, then say which checkpoint is
    the last one.

    NOTE: every rank raises these together (the loss and gradient norm are reduced over all
    ranks, the save guard agrees over the checkpoint group), so every rank can take part in
    finishing the pending save; other errors may be one rank's, and are left to the launcher.
    """
    try:
        yield
    except FloatingPointError as err:
        try:
            checkpointer.wait()
        except CheckpointIOError as lost:
            raise FloatingPointError(
                f"{err}; and the pending checkpoint {summary.last_checkpoint} failed: {lost}"
            ) from None
        last = summary.last_checkpoint or summary.resumed_from
        raise FloatingPointError(
            f"{err}; the last checkpoint is {last}" if last else f"{err}; no checkpoint was saved"
        ) from None


def _gloo_group() -> dist.ProcessGroup:
    """A new gloo group of every rank; this rank is a member, so it is a real group (never
    ``GroupMember.NON_GROUP_MEMBER``)."""
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)
    return group


def _agreed_resume_point(cfg: ForgeConfig, group: dist.ProcessGroup) -> Path | None:
    """The checkpoint every rank resumes from: rank 0 picks and verifies it
    (:func:`forge.resume.resume_point`) and tells the others.

    NOTE: one read of the checkpoint in all, not one per rank; a refusal reaches every rank as
    the same error (a damaged checkpoint, or one saved for another model), so each exits with
    one line. forge's launcher has done this before starting ranks and passes a path with
    ``checkpoint.verify = false``.
    """
    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            chosen, skipped = resume_point(cfg)
            for line in skipped:
                print(f"forge train: skipping damaged checkpoint {line}", file=sys.stderr)
            verdict = [("ok", None if chosen is None else str(chosen))]
        except CheckpointDamaged as e:
            verdict = [("damaged", str(e))]
        except ForgeConfigError as e:
            verdict = [("config", str(e))]
    dist.broadcast_object_list(verdict, src=0, group=group)
    kind, value = verdict[0]
    if kind == "damaged":
        raise CheckpointDamaged(value)
    if kind == "config":
        raise ForgeConfigError(value)
    return None if value is None else Path(value)


def run_train(cfg_dict: dict[str, Any], device_type: str = "cpu") -> TrainSummary:
    """One rank's part of ``forge train``; rank 0's summary holds the steps and the report."""
    cfg = load_config(cfg_dict)
    t, ck = cfg.training, cfg.checkpoint
    rank, device, layout, mesh = setup_rank(cfg, device_type)
    world_size, par = layout.world_size, layout.parallelism
    plan = ParallelPlan.from_config(cfg, mesh, layout=layout)  # as forge build
    weights = model_kind(cfg).weights()  # a Hugging Face directory's, read sharded
    model = plan.parallelize(model_from_config(cfg), device=device, seed=t.seed, weights=weights)
    model = plan.maybe_compile(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(trainable, lr=t.lr, weight_decay=t.weight_decay, impl=t.optimizer_impl)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: warmup_cosine(
            s, warmup_steps=t.warmup_steps, total_steps=t.steps, min_ratio=t.min_lr_ratio
        ),
    )
    hooks = attach_optimizer_hooks(model, optimizer)
    # NOTE: the stop vote and the checkpoint writer get gloo groups of their own: both are
    # host-side traffic, and an asynchronous save runs its collectives from a background thread,
    # which must never interleave with the training thread's collectives on one group.
    control = _gloo_group()
    ckpt_root = cfg.checkpoint_dir
    checkpointer = Checkpointer(
        ckpt_root,
        keep=ck.keep,
        async_save=ck.async_save,
        process_group=_gloo_group(),
    )
    summary = TrainSummary()
    resume = _agreed_resume_point(cfg, control)
    if resume is not None:
        state = checkpointer.load(resume, model, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        summary.start_step, summary.resumed_from = state["step"], str(resume)
    wrapper = unwrap(model)
    ignore = getattr(wrapper, "image_token_id", None)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    kind = model_kind(cfg)
    data = kind.data(
        dp_rank, dp_size, image_token_id=ignore, image_tokens=getattr(wrapper, "image_tokens", 0)
    )
    held_out = kind.validation_data(dp_rank, dp_size) if cfg.metrics.validation_every else None
    flops_per_item, unit, items_per_step = kind.throughput()
    run_id = uuid.uuid4().hex[:8]
    log = None
    if rank == 0:
        names, sizes = mesh_layout(par, world_size)
        start = {
            "run_id": run_id,
            "time": time.time(),
            "world_size": world_size,
            "mesh": dict(zip(names, sizes, strict=True)),
            "device": device_type,
            "start_step": summary.start_step,
            "resumed_from": summary.resumed_from,
            "config": asdict(cfg),
        }
        log = RunLog(
            cfg,
            start,
            unit,
            items_per_step,
            flops_per_item,
            peak_flops(device),
            world_size,
            steps=summary.steps,
            validation=summary.validation,
        )
    stop = StopFlag()
    profiler = StepProfiler(cfg.metrics.profile_step, t.out_dir, rank, device)
    last_saved = summary.start_step if resume is not None else None
    finished = summary.start_step

    def save(step: int) -> None:
        nonlocal last_saved
        # NOTE: finite loss and gradients can still overflow a parameter (a huge lr) or a
        # buffer (the MoE routers' balancing bias): Checkpointer.save counts the non-finite
        # values of every rank's state and raises FloatingPointError before writing anything.
        train_state = {
            "data_position": step,  # the data is indexed by step: resume reads batch `step` next
            "scheduler": scheduler.state_dict(),
            "mesh": dict(zip(*mesh_layout(par, world_size), strict=True)),
            "run_id": run_id,
            "config": asdict(cfg),
        }
        try:
            summary.last_checkpoint = str(checkpointer.save(step, model, optimizer, train_state))
        except FloatingPointError as err:
            raise FloatingPointError(
                f"step {step}: {err} (lower training.lr={t.lr}, raise training.warmup_steps or "
                "set training.max_grad_norm)"
            ) from None
        last_saved = step
        if ck.export_hf:
            _export_hf(checkpointer, summary, t.out_dir, step, rank)

    with (
        stop.installed(),
        warnings.catch_warnings(),
        _published_before_failure(checkpointer, summary),
    ):
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        for step in range(summary.start_step, t.steps):
            with profiler.step(step + 1) as profiled:
                begin = time.perf_counter()
                batch = data.batch(step)
                loss_sum, global_count = kind.train_step(model, batch, mesh, device, ignore)
                grad_norm = float(clip_grad_norm_(trainable, t.max_grad_norm, mesh=mesh))
                loss = float(loss_sum / global_count)
                # NOTE: before optimizer.step(): a non-finite loss or gradient norm (both reduced
                # over every rank, so every rank stops here together) never reaches the parameters,
                # so the last checkpoint written stays the last good state.
                for what, value in (("loss", loss), ("gradient norm", grad_norm)):
                    if not math.isfinite(value):
                        raise FloatingPointError(
                            f"{what} is {value} at step {step + 1}; stopped before the optimizer "
                            "step, no checkpoint of it is written (lower "
                            f"training.lr={t.lr}, raise training.warmup_steps or set "
                            "training.max_grad_norm)"
                        )
                lr = float(scheduler.get_last_lr()[0])  # a float already: LambdaLR scales float lrs
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - begin
            # One host-side collective per step: every rank's peak memory and its stop vote.
            mine = torch.tensor([peak_memory(device), stop.signum], dtype=torch.int64)
            everyone = [torch.zeros_like(mine) for _ in range(world_size)]
            dist.all_gather(everyone, mine, group=control)
            memory = [int(m[0]) for m in everyone]
            votes = [int(m[1]) for m in everyone]
            done = finished = step + 1
            if log is not None:
                log.step(done, loss, grad_norm, lr, elapsed, memory, profiled=profiled.active)
            _validate(cfg, model, held_out, mesh, device, done, log)
            if ck.every and done % ck.every == 0:
                save(done)
            if any(votes):
                summary.stopped_by = stop.stopped_by(votes)
                break
        if (summary.stopped_by or ck.save_at_end) and last_saved != finished:
            save(finished)
        checkpointer.wait()
        # NOTE: still under the stop flag: a signal from here on (a late one: a rank's watcher
        # noticing the stopped forkserver after the vote) has nothing left to stop, and under
        # the default handler it would kill a rank whose run has finished.
        hooks.remove()
        if log is not None:
            end = {"run_id": run_id, "step": finished, "stopped_by": summary.stopped_by}
            log.close({**end, "checkpoint": summary.last_checkpoint})
            tp_text = tp_description(model, par) if par.tp > 1 else None
            summary.text = _report(cfg, par, world_size, device_type, summary, finished, tp_text)
    return summary


def _validate(
    cfg: ForgeConfig,
    model: nn.Module,
    held_out: StepData[Batch] | None,
    mesh: DeviceMesh,
    device: torch.device,
    step: int,
    log: RunLog | None,
) -> None:
    """The validation loss after ``step`` when ``metrics.validation_every`` asks (every rank
    computes it; rank 0, which holds ``log``, records it)."""
    every = cfg.metrics.validation_every
    if held_out is None or not every or step % every:
        return
    loss = validation_loss(model, held_out, cfg.metrics.validation_batches, mesh, device)
    if log is not None:
        log.validation_loss(step, loss)


def _export_hf(
    checkpointer: Checkpointer, summary: TrainSummary, out_dir: str, step: int, rank: int
) -> None:
    """The checkpoint just saved as a Hugging Face directory ``<out_dir>/hf/step-N``, written by
    rank 0 one shard at a time (``checkpoint.export_hf``), once the save is on disk."""
    from .export import export_checkpoint

    checkpointer.wait()  # NOTE: an asynchronous save must be complete to be read
    if rank != 0 or summary.last_checkpoint is None:
        return
    out = Path(out_dir) / "hf" / f"step-{step:08d}"
    written = export_checkpoint(summary.last_checkpoint, out, layout="hf", verify=False)
    summary.hf_exports.append(str(written))


def _report(
    cfg: ForgeConfig,
    par: Any,
    world_size: int,
    device_type: str,
    s: TrainSummary,
    finished: int,
    tp_text: str | None = None,
) -> str:
    names, sizes = mesh_layout(par, world_size)
    t = cfg.training
    layout = " x ".join(f"{n}={z}" for n, z in zip(names, sizes, strict=True))
    model, data = model_kind(cfg).describe()
    lines = [
        f"forge train: {world_size} rank(s) on {device_type}, {layout}; {model}",
        f"data:   {data}; global batch {t.global_batch_size}, grad_accum {t.grad_accum}",
        *([f"tp:     {tp_text}"] if tp_text else []),
    ]
    if s.resumed_from:
        lines.append(f"resumed from {s.resumed_from} at step {s.start_step}")
    if s.steps:
        first, last = s.steps[0], s.steps[-1]
        lines.append(
            f"steps {first.step}-{last.step}: loss {first.loss:.4f} -> {last.loss:.4f}; last grad norm {last.grad_norm:.3f}"
        )
    if s.resumed_from and not s.steps:
        lines.append(
            f"nothing to train: the checkpoint is at step {s.start_step} and training.steps="
            f"{t.steps}; raise training.steps, or give a fresh run its own checkpoint.dir (a new "
            "run with checkpoint.resume=none would save over these checkpoints)"
        )
    if s.stopped_by:
        lines.append(f"stopped by {s.stopped_by} after step {finished}")
    if s.last_checkpoint:
        lines.append(f"checkpoint: {s.last_checkpoint}")
    if s.hf_exports:
        lines.append(f"hugging face: {s.hf_exports[-1]}")
    lines.append(f"metrics: {Path(t.out_dir) / 'metrics.jsonl'}")
    return "\n".join(lines)
