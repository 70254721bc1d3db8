"""build_parallel_model and `forge build`: the pipeline, the report, the CLI's errors and exit codes."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from float8_markers import needs_torchao
from forge import load_config
from forge.build import build_parallel_model
from forge.cli import main
from forge.job import run_build
from forge_core import ForgeConfigError, ModelConfig, applied_stages
from forge_mesh import build_device_mesh
from forge_vlm import VLMConfig

CFG = ModelConfig.preset("debug")
ROOT = Path(__file__).resolve().parents[2]


def _pipeline_stages() -> list[str]:
    mesh = build_device_mesh({}, "cpu")
    model = build_parallel_model(
        CFG, "cpu", mesh, ac_mode="full", compile_model=True, param_dtype=torch.float32
    )
    return applied_stages(model)


def test_pipeline_applies_ac_compile_fsdp2_in_order(run_on_ranks):
    assert run_on_ranks(2, _pipeline_stages)[0] == ["ac", "compile", "fsdp2"]


def test_a_vlm_needs_all_three_of_its_configs():
    with pytest.raises(ForgeConfigError, match="vision_config, adapter_config and vlm_config"):
        build_parallel_model(CFG, "cpu", None, vlm_config=VLMConfig())


def test_single_device_vlm_build_runs_tokens_and_images():
    cfg = load_config({"model": {"preset": "debug_vlm"}})
    model = build_parallel_model(
        cfg.decoder,
        "cpu",
        None,
        vision_config=cfg.vision,
        adapter_config=cfg.adapter,
        vlm_config=cfg.vlm,
        param_dtype=torch.float32,
    )
    tokens = torch.zeros(2, 20, dtype=torch.long)
    tokens[:, 2:18] = model.image_token_id
    assert model(tokens, torch.randn(2, 3, 16, 16)).shape == (2, 20, cfg.model.vocab_size)


def test_single_device_build_without_a_mesh():
    model = build_parallel_model(CFG, "cpu", None, param_dtype=torch.float32)
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, CFG.vocab_size)
    assert applied_stages(model) == []


def _job(overrides: list[str]):
    os.environ["WORLD_SIZE"] = "4"
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    return run_build(dataclasses.asdict(load_config(None, overrides)), "cpu")


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallelism.dp_replicate=2", "training.ac_mode=op"],
        ["parallelism.tp=1", "parallelism.data=ddp", "training.grad_accum=2"],
        ["tp.loss_parallel=true", "training.ac_mode=selective"],
        ["parallelism.tp=4", "model.n_kv_heads=4", "tp.sequence_parallel=false"],
        ["model.preset=debug_tied", "training.cpu_offload=true", "training.steps=3"],
        ["parallelism.cp=2", "training.ac_mode=full"],  # cp 2 x tp 2, FSDP2 over cp
    ],
)
def test_build_job_reports_pass_for_other_layouts(run_on_ranks, overrides):
    reports = run_on_ranks(4, _job, overrides)
    assert [r.text for r in reports[1:]] == ["", "", ""] and all(r.passed for r in reports)
    report = reports[0]
    assert report.passed, report.text
    assert "PASS: parallel run matches the single-device model" in report.text


@pytest.mark.parametrize(
    ("overrides", "moe_line"),
    [
        (
            ["model.preset=debug_moe"],
            "ep=2 (4 experts per rank), dispatch dropless; tokens dropped 0 of 2560 routed in 5 "
            "steps; host syncs counted in one forward+backward: 2 (Tensor.tolist x2)",
        ),
        (
            ["model.preset=debug_moe", "parallelism.tp=1", "moe.moe_dispatch=capacity"]
            + ["moe.capacity_factor=1.0"],
            "ep=4 (2 experts per rank), dispatch capacity; tokens dropped",
        ),
    ],
)
def test_build_job_runs_fsdp2_with_expert_parallelism(run_on_ranks, overrides, moe_line):
    report = run_on_ranks(4, _job, overrides)[0]
    assert report.passed, report.text
    assert "stages: " in report.text and "ep -> fsdp2" in report.text
    assert moe_line in report.text
    if "capacity" in moe_line:
        assert "forward+backward: 0 (rank 0)" in report.text


@pytest.mark.parametrize(
    ("overrides", "lines"),
    [
        (
            ["model.preset=debug_vlm"],
            [
                "16 image tokens at placeholder id 255; encoder trainable, FSDP2 per block; no AC",
                "per component: encoder fsdp2; decoder tp -> fsdp2",
                "tp:     decoder registered plan over 2 ranks, sequence_parallel=True",
            ],
        ),
        (
            ["model.preset=debug_vlm", "vlm.freeze_encoder=true", "vlm.encoder_tp=true"]
            + ["training.ac_mode=full", "adapter.pool=2"],
            [
                "-> adapter (pool 2) -> 4 image tokens",
                "encoder frozen, replicated outside FSDP2 (no gradients, no optimizer state); "
                "AC full (scope all) on decoder",
                "tp:     encoder opt-in attributes plan over 2 ranks, sequence_parallel=False",
            ],
        ),
    ],
    ids=["default", "frozen-encoder-tp-ac-pool"],
)
def test_build_job_runs_a_vision_language_model(run_on_ranks, overrides, lines):
    report = run_on_ranks(4, _job, overrides)[0]
    assert report.passed, report.text
    for line in lines:
        assert line in report.text, report.text


@needs_torchao
def test_build_job_runs_float8_with_fsdp2_and_tp(run_on_ranks):
    overrides = ["float8.enabled=true", "training.param_dtype=bfloat16", "training.steps=3"]
    report = run_on_ranks(4, _job, overrides)[0]
    assert report.passed, report.text
    assert "stages: tp -> float8 -> fsdp2" in report.text
    assert (
        "float8 tensorwise: 14 Linear(s) converted, 1 skipped, fsdp fp8 all-gather off"
        in report.text
    )
    assert "tp styles carried over: ColwiseParallel x10, RowwiseParallel x4" in report.text


@pytest.mark.parametrize("data", ["fsdp2", "ddp"])
def test_bf16_compute_is_checked_with_low_precision_tolerances(run_on_ranks, data):
    overrides = ["training.param_dtype=bfloat16", "training.steps=3", f"parallelism.data={data}"]
    report = run_on_ranks(4, _job, overrides + (["parallelism.tp=1"] if data == "ddp" else []))[0]
    assert report.passed, report.text
    assert "tolerances: step-1 loss 2e-02" in report.text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["build", "--set", "parallelism.tp=3"], "world size 4 is not divisible by"),
        (
            ["build", "--set", "parallelism.tp=4"],
            "tp=4 does not divide n_kv_heads=2; choose tp in {1, 2}",
        ),
        (["build", "--set", "training.seq_len=31"], "sequence length 31 is not divisible by tp=2"),
        (
            ["build", "--set", "parallelism.data=ddp"],
            "data='ddp' with tp=2: DDP does not handle tensor-parallel",
        ),
        (["build", "--set", "tp.plan=os:getcwd"], "importing 'os' runs its code"),
        (
            ["build", "--set", "training.stepz=3"],
            "unknown key 'training.stepz' (did you mean 'steps'?)",
        ),
        (
            ["build", "--set", "parallelism.ep=2"],
            "expert parallelism (parallelism.ep=2) on a model with no forge_moe_ep.MoE layer",
        ),
        (
            [
                "build",
                "--set",
                "float8.enabled=true",
                "--set",
                "float8.fsdp_float8_all_gather=true",
            ],
            "float8.fsdp_float8_all_gather=true with tp > 1",
        ),
        (["build", "--set", "float8.recipe=rowwize"], "did you mean 'rowwise'"),
        (
            ["build", "--set", "model.preset=debug_moe", "--set", "parallelism.tp=1"]
            + ["--set", "parallelism.ep=4", "--set", "moe.num_experts=6"],
            "parallelism.ep=4 does not divide moe.num_experts=6",
        ),
        (
            ["build", "--set", "model.preset=debug_vlm", "--set", "vision.patch_size=5"],
            "vision.image_size=16 is not divisible by vision.patch_size=5",
        ),
        (
            ["build", "--set", "model.preset=debug_vlm", "--set", "vlm.encoder_tp=true"]
            + ["--set", "vision.n_heads=1"],
            "tp=2 does not divide vision.n_heads=1",
        ),
        (
            ["build", "--set", "model.preset=debug_vlm", "--set", "adapter.out_dim=32"],
            "adapter.out_dim=32 differs from the decoder's model.dim=64",
        ),
        (
            ["build", "--set", "model.preset=debug_vlm", "--set", "training.seq_len=8"],
            "each image becomes 16 tokens",
        ),
        (
            ["build", "--set", "model.preset=debug_vlm", "--set", "vlm.freeze_encoder=true"]
            + ["--set", "vlm.ac_scope=vision", "--set", "training.ac_mode=full"],
            "ac_scope='vision' with a frozen encoder",
        ),
        (["build", "--set", "vlm.ac_scope=lang"], "choose one of ['all', 'language', 'vision']"),
        (
            ["build", "--set", "parallelism.tp=1", "--set", "parallelism.domain=2"],
            "parallelism.domain=2: domain parallelism splits 2-D fields",
        ),
        (["build", "--nproc", "3"], "world size 3 is not divisible by"),
        (
            ["build", "--nproc", "6"],
            "global_batch_size=8 must be divisible by the 3 data-parallel ranks",
        ),
        (["build", "does-not-exist.toml"], "config file 'does-not-exist.toml' does not exist"),
    ],
)
def test_cli_bad_config_exits_2_before_launching(capsys, args, message):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit) as info:
        main(["build", "--nproc", "0"])
    assert info.value.code == 2


def test_forge_build_default_prints_a_passing_report():
    """The README's first command, end to end: 4 CPU ranks started by forge's own launcher."""
    script = Path(sys.executable).with_name("forge")
    # NOTE: run from sources on PYTHONPATH (the GPU-image lane) forge has no console script;
    # the module is the entry point it would call.
    forge = [str(script)] if script.exists() else [sys.executable, "-m", "forge.cli"]
    proc = subprocess.run([*forge, "build"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "mesh:   dp_shard=2 x tp=2  (data=fsdp2)" in out
    assert "stages: tp -> fsdp2" in out
    assert "tp:     registered plan over 2 ranks, sequence_parallel=True" in out
    assert "layers.*.attention.wq     ColwiseParallel(in R -> out S(-1))" in out
    assert "tp grads: every parameter replicated over tp has the same gradient" in out
    assert "r3 123,520 B (29%)" in out
    assert out.count("\n   ") >= 5 and "PASS: parallel run matches the single-device model" in out
    assert _shown_in_docs_cli() == _stable_lines(out)


def _stable_lines(report: str) -> list[str]:
    """A report's lines less those that vary by machine and torch version: the step rows
    (float rounding) and the timings."""
    return [
        line
        for line in report.splitlines()
        if not re.match(r"\s+\d+\s", line) and "time" not in line
    ]


def _shown_in_docs_cli() -> list[str]:
    """The ``forge build`` report that docs/cli.md shows (its first fenced block that starts
    with the report's header), less the lines :func:`_stable_lines` leaves out."""
    text = (ROOT / "docs" / "cli.md").read_text()
    block = re.search(r"```\n(forge build: .*?)```", text, re.S)
    assert block is not None, "docs/cli.md shows no forge build report"
    return _stable_lines(block.group(1))
