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


def _cfg(out: Path, impl: str, preset: str = "debug", parallelism: dict | None = None) -> dict:
    return {
        "model": {"preset": preset},
        "parallelism": parallelism or {"dp_shard": 2},
        "training": {
            "steps": 4,
            "out_dir": str(out),
            "lr": 3e-3,
            "weight_decay": 0.1,
            "optimizer_impl": impl,
        },
        "checkpoint": {"save_at_end": False, "resume": "none"},
    }


def _runs(
    base: str, impls: tuple[str, ...] = IMPLS, preset: str = "debug", par: dict | None = None
) -> dict[str, list[tuple[float, float]]]:
    """Each implementation's (loss, grad norm) per step, in one rank process per rank."""
    out = {}
    for impl in impls:
        summary = run_train(_cfg(Path(base) / impl, impl, preset, par), "cpu")
        out[impl] = [(s.loss, s.grad_norm) for s in summary.steps]
    return out


def _assert_same_runs(runs: dict[str, list[tuple[float, float]]]) -> None:
    reference = runs["for-loop"]
    assert len(reference) == 4 and reference[-1][0] < reference[0][0]  # it learns
    for impl in set(runs) - {"for-loop"}:
        for (loss, norm), (ref_loss, ref_norm) in zip(runs[impl], reference, strict=True):
            assert loss == pytest.approx(ref_loss, rel=1e-5), impl
            assert norm == pytest.approx(ref_norm, rel=1e-5), impl


def test_each_implementation_trains_the_same_run(run_on_ranks, tmp_path):
    _assert_same_runs(run_on_ranks(2, _runs, str(tmp_path))[0])


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("preset", "par"),
    [("debug_moe", {"dp_shard": 4, "ep": 2}), ("debug", {"dp_shard": 2, "tp": 2})],
    ids=["ep2-fsdp4", "tp2-fsdp2"],
)
def test_fused_steps_parameters_on_several_meshes_as_the_for_loop(
    run_on_ranks, tmp_path, preset, par
):
    """Fused AdamW (the default on a GPU) takes one kernel per dtype and device over DTensors of
    different meshes: EP experts beside FSDP2 shards, TP shards on a 2-D mesh."""
    impls = ("for-loop", "fused")
    runs = run_on_ranks(4, _runs, str(tmp_path), impls, preset, par)[0]
    _assert_same_runs(runs)


@pytest.mark.parametrize(("impl", "flags"), [("auto", (None, None)), ("for-loop", (False, None)),
                                             ("foreach", (True, None)), ("fused", (None, True))])  # fmt: skip
def test_the_implementation_reaches_torch(impl, flags):
    import torch

    group = adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-3, weight_decay=0.0, impl=impl)
    assert (group.defaults["foreach"], group.defaults["fused"]) == flags


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_auto_is_fused_on_a_gpu():
    import torch

    group = adamw([torch.nn.Parameter(torch.ones(2, device="cuda"))], lr=1e-3, weight_decay=0.0)
    assert group.defaults["fused"] is True


def test_auto_is_fused_when_every_parameter_is_on_a_gpu(monkeypatch):
    """The rule without a GPU: parameters that say they are on CUDA get the fused update (CPU
    has a fused AdamW too, so the optimizer builds); one parameter elsewhere keeps torch's."""
    import forge.optim as optim
    import torch

    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    on_gpu = {id(params[0])}
    monkeypatch.setattr(optim, "_local", lambda p: type("T", (), {"is_cuda": id(p) in on_gpu}))
    assert adamw(params, lr=1e-3, weight_decay=0.0).defaults["fused"] is None
    on_gpu.add(id(params[1]))
    assert adamw(params, lr=1e-3, weight_decay=0.0).defaults["fused"] is True


def test_an_unknown_implementation_is_refused_with_the_choices(tmp_path):
    with pytest.raises(
        ForgeConfigError, match="training.optimizer_impl='fusd'.*did you mean 'fused'"
    ):
        load_config(_cfg(tmp_path, "fusd"))


def _resumed(base: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """4 for-loop steps saving at step 2; then steps 3-4 again, resumed from that checkpoint
    with fused AdamW."""
    whole_cfg = _cfg(Path(base), "for-loop")
    whole_cfg["checkpoint"] = {"every": 2, "save_at_end": False, "resume": "none"}
    whole = run_train(whole_cfg, "cpu")
    second = _cfg(Path(base) / "resumed", "fused")
    step2 = str(Path(base) / "checkpoints" / "step-00000002")
    second["checkpoint"] = {"dir": str(Path(base) / "checkpoints"), "resume": step2}
    second["checkpoint"]["save_at_end"] = False
    resumed = run_train(second, "cpu")
    return [(s.loss, s.grad_norm) for s in whole.steps], [
        (s.loss, s.grad_norm) for s in resumed.steps
    ]


@pytest.mark.heavy
def test_a_checkpoint_resumes_under_another_implementation(run_on_ranks, tmp_path):
    """A run saved with one implementation continues with another (a CPU run resumed on a GPU
    switches from the for-loop to fused): the optimizer state means the same to both."""
    whole, resumed = run_on_ranks(2, _resumed, str(tmp_path))[0]
    assert len(resumed) == 2
    for (loss, norm), (ref_loss, ref_norm) in zip(resumed, whole[2:], strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)
