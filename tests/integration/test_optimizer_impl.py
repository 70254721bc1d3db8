"""``training.optimizer_impl``: forge train's AdamW as a for-loop, foreach or fused
implementation (torch's three), on FSDP2-sharded parameters: the same run to fp32 rounding,
and a name torch does not have refused with the choices."""

from __future__ import annotations

from pathlib import Path

import pytest
from forge.config import load_config
from forge.optim import adamw
from forge.train import run_train
from forge_core.errors import ForgeConfigError

IMPLS = ("for-loop", "foreach", "fused")


def _cfg(out: Path, impl: str) -> dict:
    return {
        "model": {"preset": "debug"},
        "parallelism": {"dp_shard": 2},
        "training": {
            "steps": 4,
            "out_dir": str(out),
            "lr": 3e-3,
            "weight_decay": 0.1,
            "optimizer_impl": impl,
        },
        "checkpoint": {"save_at_end": False, "resume": "none"},
    }


def _runs(base: str) -> dict[str, list[tuple[float, float]]]:
    """Each implementation's (loss, grad norm) per step, in one rank process per rank."""
    out = {}
    for impl in IMPLS:
        summary = run_train(_cfg(Path(base) / impl, impl), "cpu")
        out[impl] = [(s.loss, s.grad_norm) for s in summary.steps]
    return out


def test_each_implementation_trains_the_same_run(run_on_ranks, tmp_path):
    runs = run_on_ranks(2, _runs, str(tmp_path))[0]
    reference = runs["for-loop"]
    assert len(reference) == 4 and reference[-1][0] < reference[0][0]  # it learns
    for impl in ("foreach", "fused"):
        for (loss, norm), (ref_loss, ref_norm) in zip(runs[impl], reference, strict=True):
            assert loss == pytest.approx(ref_loss, rel=1e-5), impl
            assert norm == pytest.approx(ref_norm, rel=1e-5), impl


@pytest.mark.parametrize(("impl", "flags"), [("auto", (None, None)), ("for-loop", (False, None)),
                                             ("foreach", (True, None)), ("fused", (None, True))])  # fmt: skip
def test_the_implementation_reaches_torch(impl, flags):
    import torch

    group = adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-3, weight_decay=0.0, impl=impl)
    assert (group.defaults["foreach"], group.defaults["fused"]) == flags


def test_an_unknown_implementation_is_refused_with_the_choices(tmp_path):
    with pytest.raises(
        ForgeConfigError, match="training.optimizer_impl='fusd'.*did you mean 'fused'"
    ):
        load_config(_cfg(tmp_path, "fusd"))
