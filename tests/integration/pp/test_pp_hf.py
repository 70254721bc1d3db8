"""Hugging Face decoders cut into pipeline stages equal one device: Llama, Qwen3 and Qwen3-MoE
(tiny configs, random weights, fp32) at pp=2 under 1F1B and Interleaved1F1B, pp=2 x tp=2 (their
own ``_tp_plan``) and pp=2 x ep=2 (Qwen3-MoE's blocks as forge's MoE), loss AND gradient norm
over 10 steps; pretrained weights (``save_pretrained``) read into the stages, each rank its own
tensors, through the Python API and ``forge train``; what a rank holds; checkpoints across
pipeline layouts through ``forge train``; the refusals, before launch, in the split and when the
weights do not fit.

Rank processes are reused: one call per world size runs every case of that size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from forge_checkpoint.dcp import SafeFileSystemReader

from tests.integration.pp.hf_jobs import (
    PP2,
    edited_hf_dir,
    hf_pipeline_parities,
    hf_pipeline_refusals,
    hf_pretrained_pipeline,
    hf_rank_facts,
    meta_hf,
    save_hf_dir,
    save_hf_weights,
    train_runs,
)

#: What this module's rank functions import inside the function: the rank workers' forkserver
#: imports it once (forge_core.testing.pytest_ranks).
RANK_PRELOAD = ["transformers"]

# NOTE: the Hugging Face lane (marker zoo), which runs in both venvs (transformers 5.23 and the
# GPU machines' 5.17).
pytestmark = pytest.mark.zoo

FAMILIES = ("llama", "qwen3", "qwen3_moe")


def _assert_all(results: dict) -> None:
    failed = {key: r.table() for key, r in results.items() if not r.passed}
    assert not failed, "\n\n".join(f"{key}:\n{table}" for key, table in failed.items())


def test_hf_decoders_at_pp2_match_one_device_under_1f1b_and_interleaved(run_on_ranks):
    cases = [
        (name, PP2, pp)
        for name in FAMILIES
        for pp in ({"schedule": "1F1B"}, {"schedule": "Interleaved1F1B", "stages_per_rank": 2})
    ]
    results = run_on_ranks(2, hf_pipeline_parities, cases)[0]
    assert len(results) == len(cases)
    _assert_all(results)


def test_hf_decoders_at_pp2_x_tp2_and_pp2_x_ep2_match_one_device(run_on_ranks, tmp_path):
    """Also Qwen3-MoE's pretrained weights (experts stored one by one) read into pp=2 x ep=2
    stages against transformers' own model loaded on one device."""
    moe = save_hf_weights(tmp_path / "qwen3_moe", "qwen3_moe")
    cases: list[tuple] = [
        (name, {"pp": 2, "tp": 2, "data": "none"}, {"schedule": "1F1B"}) for name in FAMILIES
    ]
    cases.append(("qwen3_moe", {"pp": 2, "dp_shard": 2, "ep": 2}, {"schedule": "1F1B"}))
    cases.append(("qwen3_moe", {"pp": 2, "dp_shard": 2, "ep": 2}, {"schedule": "1F1B"}, moe))
    results = run_on_ranks(4, hf_pipeline_parities, cases)[0]
    assert len(results) == len(cases)
    _assert_all(results)


def test_pretrained_weights_fill_pipeline_stages_as_one_device(run_on_ranks, tmp_path):
    """A Llama directory save_pretrained wrote, read into pp=2 (1F1B) stages (each rank its own
    layers' tensors), equals the same directory on one device over 10 steps and transformers'
    own model at step 1. A tensor no rank holds, or one the second rank needs and the files lack,
    is refused on BOTH ranks with the same one line, before any read."""
    weights = save_hf_weights(tmp_path / "llama")
    broken = {
        "extra": edited_hf_dir(weights, tmp_path / "extra", add="model.layers.9.mlp.up.weight"),
        "lacking": edited_hf_dir(
            weights, tmp_path / "lacking", drop="model.layers.3.mlp.down_proj.weight"
        ),
    }
    first, second = run_on_ranks(2, hf_pretrained_pipeline, weights, broken)
    parity = first["parity"]
    assert parity.passed, parity.table()
    hf_loss, loss = first["hf_loss"], parity.parallel[0].loss
    assert abs(loss - hf_loss) <= 1e-5 * hf_loss, (loss, hf_loss)
    assert abs(parity.reference[0].loss - hf_loss) <= 1e-5 * hf_loss
    for said in (first, second):
        assert (
            "1 tensor(s) the model does not have (model.layers.9.mlp.up.weight)" in said["extra"]
        ), said
        assert (
            "lack 1 tensor(s) the model has (model.layers.3.mlp.down_proj.weight)"
            in said["lacking"]
        ), said
        assert "\n" not in said["extra"] + said["lacking"], said
    assert first["extra"] == second["extra"] and first["lacking"] == second["lacking"]


def test_a_rank_holds_its_layers_under_the_hugging_face_names(run_on_ranks):
    first, last = run_on_ranks(2, hf_rank_facts, "qwen3")
    assert first["layers"] == ["0", "1"] and last["layers"] == ["2", "3"]
    assert first["class"] == "Qwen3ForCausalLM"
    assert "model.embed_tokens.weight" in first["names"] and "lm_head.weight" in last["names"]
    assert "lm_head.weight" not in first["names"] and "model.norm.weight" in last["names"]
    assert "model.layers.3.self_attn.q_proj.weight" in last["names"]
    assert not set(first["names"]) & set(last["names"])


def test_the_split_refuses_what_it_does_not_cut_in_one_line(run_on_ranks):
    said = run_on_ranks(2, hf_pipeline_refusals)[0]
    assert "Hugging Face 'qwen2' model" in said["family"], said
    assert "set parallelism.pp=1" in said["family"], said
    assert "tie_word_embeddings=true" in said["tied"], said
    assert "sliding-window" in said["window"], said
    assert said["structure"].startswith("LlamaModel cannot be cut into pipeline stages"), said
    assert "has no model.embed_tokens, model.layers" in said["structure"], said
    assert "attn_implementation='flex_attention'" in said["attention"], said
    assert all("\n" not in text for text in said.values()), said


def _config_problems(model_dir: str, *overrides: str) -> list[str]:
    from forge.checks import config_problems
    from forge.config import load_config

    sets = [f"model.hf={model_dir}", "model.pretrained=false", "parallelism.pp=2"]
    sets += ["parallelism.tp=1", "parallelism.data=none", *overrides]
    return config_problems(load_config(None, sets), 2)


def _launch_problems(model_dir: str) -> list[str]:
    """What the launcher says of pretrained weights at pp=2: the value checks, then the ones
    that import (the weights' headers against the whole model, built on meta)."""
    from forge.checks import import_problems
    from forge.config import load_config

    sets = [f"model.hf={model_dir}", "parallelism.pp=2", "parallelism.data=none"]
    cfg = load_config(None, [*sets, "parallelism.tp=1", "model.pretrained=true"])
    return _config_problems(model_dir, "model.pretrained=true") or import_problems(cfg, 2)


def test_a_pipelined_hugging_face_config_is_checked_before_launch(tmp_path):
    """pp=2 on a family forge-pp cuts has no problems, with pretrained weights too; another
    family, tied embeddings, and weights that do not fit the whole model (a tensor no pipeline
    rank holds, one the model has and the files lack) are one line each, naming the fix."""
    assert _config_problems(save_hf_dir(tmp_path / "qwen3", "qwen3")) == []
    (family,) = _config_problems(save_hf_dir(tmp_path / "qwen2", "qwen2"))
    assert "Hugging Face 'qwen2' model" in family and "set parallelism.pp=1" in family
    (tied,) = _config_problems(save_hf_dir(tmp_path / "tied", "llama", tie_word_embeddings=True))
    assert "tie_word_embeddings=true" in tied and "model.tie_embeddings" not in tied
    weights = save_hf_weights(tmp_path / "llama")
    assert _launch_problems(weights) == []
    extra = edited_hf_dir(weights, tmp_path / "extra", add="model.layers.9.mlp.up.weight")
    (unexpected,) = _launch_problems(extra)
    assert unexpected.startswith("model.hf: ") and "does not have" in unexpected, unexpected
    assert "is config.json the one these weights were saved with?" in unexpected
    lacking = edited_hf_dir(weights, tmp_path / "lack", drop="model.layers.3.mlp.down_proj.weight")
    (missing,) = _launch_problems(lacking)
    assert "lack 1 tensor(s) the model has (model.layers.3.mlp.down_proj.weight)" in missing


#: forge train on a tiny Llama directory (config only, random init): 3 steps, a checkpoint each.
TRAIN = {"global_batch_size": 8, "seq_len": 16, "warmup_steps": 1, "lr": 3e-3}


def _train(run_on_ranks, model_dir: str, out: Path, parallelism: dict, resume: Path | None):
    from forge.train import run_train

    cfg = {
        "model": {"hf": model_dir, "pretrained": False},
        "parallelism": {"tp": 1, **parallelism},
        "training": {**TRAIN, "steps": 3, "out_dir": str(out)},
        "checkpoint": {
            "every": 1,
            "keep": 5,
            "save_at_end": False,
            "resume": str(resume or "none"),
        },
    }
    summary = run_on_ranks(2, run_train, cfg, "cpu")[0]
    return {s.step: (s.loss, s.grad_norm) for s in summary.steps}


def _continues(resumed: dict, full: dict, steps: list[int]) -> None:
    assert sorted(resumed) == steps, resumed
    for step, (loss, gnorm) in resumed.items():
        ref_loss, ref_gnorm = full[step]
        assert abs(loss - ref_loss) <= 1e-4 * ref_loss, (step, loss, ref_loss)
        assert abs(gnorm - ref_gnorm) <= 1e-4 * ref_gnorm, (step, gnorm, ref_gnorm)


def test_a_checkpoint_moves_between_pp2_and_pp1(run_on_ranks, tmp_path):
    """forge train at pp=2 saves every layer under its Hugging Face name; its step-1
    checkpoint resumes at pp=1 (dp_shard=2), whose step-2 checkpoint resumes at pp=2 again,
    each continuing the uninterrupted run."""
    model_dir = save_hf_dir(tmp_path / "llama")
    pp2, pp1 = {"pp": 2, "data": "none"}, {"dp_shard": 2}
    full = _train(run_on_ranks, model_dir, tmp_path / "pp2", pp2, None)
    ckpt = tmp_path / "pp2" / "checkpoints" / "step-00000001"
    saved = SafeFileSystemReader(ckpt).read_metadata().state_dict_metadata
    names = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert "model.layers.3.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert names == set(meta_hf("llama").state_dict())  # both ranks' layers, no stage prefix
    to_pp1 = _train(run_on_ranks, model_dir, tmp_path / "pp1", pp1, ckpt)
    _continues(to_pp1, full, [2, 3])
    back = tmp_path / "pp1" / "checkpoints" / "step-00000002"
    _continues(_train(run_on_ranks, model_dir, tmp_path / "back", pp2, back), full, [3])


def test_forge_train_reads_pretrained_weights_into_pp2_as_at_pp1(run_on_ranks, tmp_path):
    """forge train with pretrained = true at pp=2 (1F1B) follows the same run at pp=1
    (dp_shard=2) from the same weights: step 1 within 1e-5, the rest within 1e-4."""
    weights = save_hf_weights(tmp_path / "llama")

    def cfg(parallelism: dict, out: str) -> dict:
        return {
            "model": {"hf": weights, "pretrained": True},
            "parallelism": {"tp": 1, **parallelism},
            "training": {**TRAIN, "steps": 4, "out_dir": str(tmp_path / out)},
            "checkpoint": {"every": 0, "save_at_end": False, "resume": "none"},
        }

    pp2, pp1 = run_on_ranks(2, train_runs, [cfg(PP2, "pp2"), cfg({"dp_shard": 2}, "pp1")])[0]
    assert sorted(pp2) == sorted(pp1) == [1, 2, 3, 4], (pp2, pp1)
    for step, (loss, gnorm) in pp2.items():
        ref_loss, ref_gnorm = pp1[step]
        bound = 1e-5 if step == 1 else 1e-4
        assert abs(loss - ref_loss) <= bound * ref_loss, (step, loss, ref_loss)
        assert abs(gnorm - ref_gnorm) <= bound * ref_gnorm, (step, gnorm, ref_gnorm)
