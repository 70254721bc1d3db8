"""The parity check every layer's tests and forge build use.

Parity is forge's proof of correctness: the same model, seed and data trained on one device and
on N ranks must give the same loss and global gradient norm at every step. The reference is a
plain single-device model fed the whole global batch; the parallel model on each rank gets its
data-parallel slice; both run :func:`forge_core.training.forward_backward`, whose token-weighted
loss makes the data-parallel gradient average the gradient of the global mean.

fp32 tolerances (relative): step-1 loss <= 1e-5, every step's loss and grad norm <= 1e-4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from ..contracts import attach_optimizer_hooks
from ..training import forward_backward, global_grad_norm, local_batch, synthetic_tokens

__all__ = [
    "ParityResult",
    "StepRecord",
    "Tolerances",
    "compare_runs",
    "run_parity",
    "tolerances_for",
    "train_steps",
]


@dataclass(frozen=True)
class StepRecord:
    loss: float
    grad_norm: float


@dataclass(frozen=True)
class Tolerances:
    """Relative-error bounds for a parity check."""

    first_loss: float
    loss: float
    grad_norm: float


def tolerances_for(dtype: torch.dtype) -> Tolerances:
    """fp32: the strict bounds forge promises. Low-precision compute: bf16/fp16 rounding bounds."""
    if dtype == torch.float32:
        return Tolerances(first_loss=1e-5, loss=1e-4, grad_norm=1e-4)
    return Tolerances(first_loss=2e-2, loss=3e-2, grad_norm=5e-2)


def train_steps(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    mesh: DeviceMesh | None = None,
    lr: float = 1e-3,
    grad_accum: int = 1,
    device: torch.device | str = "cpu",
    images: torch.Tensor | None = None,
    ignore_token: int | None = None,
    positions: torch.Tensor | None = None,
) -> list[StepRecord]:
    """Train on ``tokens [steps, B, S+1]`` with AdamW through :func:`forward_backward`, and
    record each step's loss (the global token mean) and global gradient norm.

    ``positions [steps, B, S]``: packed documents (each input token's position in its
    document), kept on the CPU as the data gives them.

    With a mesh, each rank takes its DP slice of every batch. A vision-language model also gets
    ``images [steps, B, ...]``; targets equal to ``ignore_token`` (image placeholders) are left
    out of the loss. Frozen parameters (``requires_grad=False``) get no optimizer state.
    """
    # NOTE: an FSDP2 unit left gathered by an earlier forward (one without backward: an
    # evaluation; forge's last block keeps its parameters after forward) exposes its unsharded
    # parameters through parameters(): an optimizer built then would hold those copies, and
    # forge_fsdp_wrap stops it at its first step with the advice to reshard first, which this
    # does (what forge_fsdp_wrap.reshard does; forge_core imports no layer). The units of other
    # FSDP2 roots (a pipeline rank model's stage modules) are not reached: there the stop stands.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    hooks = attach_optimizer_hooks(model, optimizer)  # e.g. MoE expert-bias updates
    records = []
    for step, batch in enumerate(tokens):
        loss_sum, count = forward_backward(
            model,
            local_batch(batch, mesh).to(device),
            mesh=mesh,
            grad_accum=grad_accum,
            images=None if images is None else local_batch(images[step], mesh).to(device),
            ignore_token=ignore_token,
            positions_BS=None if positions is None else local_batch(positions[step], mesh),
        )
        grad_norm = global_grad_norm(trainable, mesh=mesh)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append(StepRecord(loss=float(loss_sum / count), grad_norm=float(grad_norm)))
    hooks.remove()
    return records


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@dataclass(frozen=True)
class ParityResult:
    """Per-step loss and grad norm of a reference and a parallel run, and the verdict."""

    reference: list[StepRecord]
    parallel: list[StepRecord]
    tolerances: Tolerances
    loss_errors: list[float] = field(init=False)
    grad_norm_errors: list[float] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "loss_errors",
            [_rel(p.loss, r.loss) for r, p in zip(self.reference, self.parallel, strict=True)],
        )
        object.__setattr__(
            self,
            "grad_norm_errors",
            [
                _rel(p.grad_norm, r.grad_norm)
                for r, p in zip(self.reference, self.parallel, strict=True)
            ],
        )

    @property
    def passed(self) -> bool:
        t = self.tolerances
        return (
            bool(self.loss_errors)
            and self.loss_errors[0] <= t.first_loss
            and max(self.loss_errors) <= t.loss
            and max(self.grad_norm_errors) <= t.grad_norm
        )

    def table(self) -> str:
        """Readable per-step comparison."""
        t = self.tolerances
        lines = [
            f"{'step':>4}  {'loss (ref)':>12}  {'loss (par)':>12}  {'rel err':>9}  "
            f"{'gnorm (ref)':>12}  {'gnorm (par)':>12}  {'rel err':>9}"
        ]
        for i, (r, p) in enumerate(zip(self.reference, self.parallel, strict=True)):
            lines.append(
                f"{i + 1:>4}  {r.loss:>12.6f}  {p.loss:>12.6f}  {self.loss_errors[i]:>9.2e}  "
                f"{r.grad_norm:>12.6f}  {p.grad_norm:>12.6f}  {self.grad_norm_errors[i]:>9.2e}"
            )
        lines.append(
            f"tolerances: step-1 loss {t.first_loss:.0e}, loss {t.loss:.0e}, grad norm {t.grad_norm:.0e}"
            f" -> {'PASS' if self.passed else 'FAIL'}"
        )
        return "\n".join(lines)

    def assert_ok(self) -> None:
        """Raise ``AssertionError`` with the table when the runs differ beyond tolerance."""
        if not self.passed:
            raise AssertionError(
                "parallel run differs from the single-device run:\n" + self.table()
            )


def compare_runs(
    reference: list[StepRecord], parallel: list[StepRecord], dtype: torch.dtype = torch.float32
) -> ParityResult:
    """Compare two runs step by step with the tolerances for ``dtype``."""
    return ParityResult(reference, parallel, tolerances_for(dtype))


def run_parity(
    reference: nn.Module,
    parallel: nn.Module,
    *,
    mesh: DeviceMesh | None,
    steps: int = 10,
    batch_size: int = 8,
    seq_len: int = 16,
    lr: float = 1e-3,
    grad_accum: int = 1,
    seed: int = 0,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ParityResult:
    """Train ``reference`` (single device, whole batch) and ``parallel`` (DP slices) on the same data."""
    if vocab_size is None:
        config = getattr(reference, "config", None)
        if config is None:
            raise ValueError("run_parity: pass vocab_size for a model without a .config")
        vocab_size = int(config.vocab_size)
    vocab = vocab_size
    tokens = synthetic_tokens(seed, steps, batch_size, seq_len, vocab)
    ref = train_steps(reference, tokens, lr=lr, device=device)
    par = train_steps(parallel, tokens, mesh=mesh, lr=lr, grad_accum=grad_accum, device=device)
    return compare_runs(ref, par, dtype)
