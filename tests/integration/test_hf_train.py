"""``forge train`` on a Hugging Face model directory and a jsonl file, against transformers.

A tiny Llama saved with ``save_pretrained`` and a tokenizer trained here (tests/hf_fixtures.py)
make the directory; ``forge train`` runs it on 4 gloo ranks (dp_shard 2 x tp 2), reading the
pretrained weights sharded and the documents packed (positions restarting at each document).
The reference is a plain single-device transformers loop over the same batches: AdamW, warmup
+ cosine, gradient clipping, the loss over the same targets. Then the checkpoint is exported
as a Hugging Face directory that ``from_pretrained`` loads, and a resume under another layout
continues the uninterrupted run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from forge import load_config
from forge.optim import warmup_cosine
from forge.train import TrainSummary, run_train

from tests.hf_fixtures import WORDS, make_tokenizer

#: Text data needs the optional ``datasets`` package (forge[data]), which the lent GPU
#: machines' software lacks: the tests that read text skip there.
needs_datasets = pytest.mark.skipif(
    __import__("importlib").util.find_spec("datasets") is None,
    reason="datasets is not installed (the forge[data] extra)",
)

RANK_PRELOAD = ["transformers.models.llama.modeling_llama", "forge.text_data"]

STEPS = 6


def _model_dir(root: Path, *, tie: bool = False) -> str:
    """A tiny Llama (random weights, seeded) and the test tokenizer, as save_pretrained
    writes them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    LlamaForCausalLM(config).save_pretrained(root)
    return make_tokenizer(root)


def _documents(path: Path, count: int = 60) -> str:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            words = [rng.choice(WORDS[:12]) for _ in range(rng.randint(3, 25))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_train")
    model = _model_dir(root / "llama")
    data = _documents(root / "docs.jsonl")
    return root, model, data


def _cfg(root: Path, model: str, data: str, out: str, **parallelism: int) -> dict:
    return {
        "model": {"hf": model},
        "parallelism": parallelism,
        "data": {"path": data, "cache_dir": str(root / "cache"), "validation_fraction": 0.1},
        "training": {
            "steps": STEPS,
            "global_batch_size": 8,
            "seq_len": 32,
            "lr": 3e-3,
            "warmup_steps": 2,
            "max_grad_norm": 1.0,
            "out_dir": str(root / out),
        },
        "checkpoint": {"every": 3, "resume": "none", "keep": 5},
        "metrics": {"validation_every": 3, "validation_batches": 2, "tensorboard": True},
    }


def _loss(model: torch.nn.Module, batch) -> torch.Tensor:
    # NOTE: use_cache=False: with a KV cache transformers skips its packed-sequence mask
    # (attention then crosses documents); forge trains without one.
    logits = model(
        input_ids=batch.tokens[:, :-1], position_ids=batch.positions, use_cache=False
    ).logits
    targets = batch.tokens[:, 1:].masked_fill(~batch.loss_mask, -100)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def _reference_steps(cfg_dict: dict) -> tuple[list, list, torch.nn.Module]:
    """The plain transformers loop on one device over forge's batches of each step."""
    from forge.kinds import model_kind
    from transformers import AutoModelForCausalLM

    cfg = load_config(cfg_dict)
    t = cfg.training
    data = model_kind(cfg).data(0, 1, image_token_id=None, image_tokens=0)
    held_out = model_kind(cfg).validation_data(0, 1)
    validation: list[tuple[int, float]] = []
    every = cfg.metrics.validation_every
    model = AutoModelForCausalLM.from_pretrained(cfg.hf.dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: warmup_cosine(
            s, warmup_steps=t.warmup_steps, total_steps=t.steps, min_ratio=t.min_lr_ratio
        ),
    )
    steps = []
    for step in range(t.steps):
        batch = data.batch(step)
        assert batch.positions is not None and batch.loss_mask is not None
        loss = _loss(model, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        steps.append((loss.item(), norm.item()))
        if every and (step + 1) % every == 0:  # the held-out loss, batches 0, 1
            assert held_out is not None
            with torch.no_grad():
                pair = [held_out.batch(i) for i in range(cfg.metrics.validation_batches)]
                sums = [(_loss(model, b) * b.loss_mask.sum(), b.loss_mask.sum()) for b in pair]
            validation.append((step + 1, float(sum(a for a, _ in sums) / sum(c for _, c in sums))))
    return steps, validation, model


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _assert_steps_match(summary: TrainSummary, reference: list) -> None:
    """forge's steps against the transformers loop's: loss and gradient norm, every step."""
    forge_steps = [(s.loss, s.grad_norm) for s in summary.steps]
    assert len(forge_steps) == STEPS
    assert _rel(forge_steps[0][0], reference[0][0]) <= 1e-5
    for (loss, norm), (ref_loss, ref_norm) in zip(forge_steps, reference, strict=True):
        assert _rel(loss, ref_loss) <= 1e-4 and _rel(norm, ref_norm) <= 1e-4


@pytest.mark.slow
@needs_datasets
def test_forge_train_on_an_hf_directory_matches_a_transformers_loop(run_on_ranks, hf_job):
    root, model, data = hf_job
    cfg = _cfg(root, model, data, "x", dp_shard=2, tp=2)
    cfg["checkpoint"]["export_hf"] = True  # a Hugging Face directory at every checkpoint
    reference, validation, trained = _reference_steps(cfg)  # NOTE: first: fills the cache
    summary = run_on_ranks(4, run_train, cfg, "cpu")[0]
    _assert_steps_match(summary, reference)
    assert reference[-1][0] < reference[0][0]  # it learns
    assert [step for step, _ in summary.validation] == [step for step, _ in validation] == [3, 6]
    for (_, loss), (_, ref_loss) in zip(summary.validation, validation, strict=True):
        assert _rel(loss, ref_loss) <= 1e-4
    assert list((root / "x" / "tensorboard").iterdir())  # [metrics] tensorboard

    # Weights out: the checkpoint as a Hugging Face directory; from_pretrained gives the
    # trained model's logits.
    from forge.export import export_checkpoint
    from transformers import AutoModelForCausalLM

    ckpt = root / "x" / "checkpoints" / f"step-{STEPS:08d}"
    out = export_checkpoint(ckpt, root / "exported", layout="hf")
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    at_checkpoints = sorted(p.name for p in (root / "x" / "hf").iterdir())
    assert at_checkpoints == ["step-00000003", f"step-{STEPS:08d}"]
    assert summary.hf_exports[-1] == str(root / "x" / "hf" / f"step-{STEPS:08d}")
    from safetensors.torch import load_file

    same = load_file(root / "x" / "hf" / f"step-{STEPS:08d}" / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert same.keys() == exported.keys()
    assert all(torch.equal(same[k], exported[k]) for k in same)
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    loaded = AutoModelForCausalLM.from_pretrained(out)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = loaded(tokens).logits, trained(tokens).logits
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-4), (got - want).abs().max()


@pytest.mark.zoo  # NOTE: 4 ranks, 6 steps: the Hugging Face lane
@needs_datasets
def test_forge_train_of_an_hf_directory_at_cp2_on_packed_text_matches_a_transformers_loop(
    run_on_ranks, hf_job
):
    """Packed documents through every piece: text tokenized and packed, the Llama's attention
    at cp=2 (transformers' attention interface, documents dealt over the ranks by their work)
    under FSDP2 over dp_shard=2 x cp, against transformers' own loop on one device, which keeps
    attention inside the documents from the same position_ids."""
    root, model, data = hf_job
    cfg = _cfg(root, model, data, "cp", dp_shard=2, cp=2)
    cfg["checkpoint"] = {"save_at_end": False, "resume": "none"}
    reference, validation, _ = _reference_steps(cfg)
    summary = run_on_ranks(4, run_train, cfg, "cpu")[0]
    _assert_steps_match(summary, reference)
    for (_, loss), (_, ref_loss) in zip(summary.validation, validation, strict=True):
        assert _rel(loss, ref_loss) <= 1e-4


@pytest.mark.slow
@needs_datasets
def test_hf_resume_under_another_layout_continues_the_run(run_on_ranks, hf_job):
    root, model, data = hf_job
    full_cfg = _cfg(root, model, data, "full", tp=2)
    full = run_on_ranks(4, run_train, full_cfg, "cpu")[0].steps
    resumed_cfg = _cfg(root, model, data, "resumed", dp_shard=4)
    resumed_cfg["checkpoint"]["resume"] = str(root / "full" / "checkpoints" / "step-00000003")
    resumed = run_on_ranks(4, run_train, resumed_cfg, "cpu")[0].steps
    assert [s.step for s in resumed] == list(range(4, STEPS + 1))
    for r, f in zip(resumed, full[3:], strict=True):
        assert _rel(r.loss, f.loss) <= 1e-4 and _rel(r.grad_norm, f.grad_norm) <= 1e-4


def _umask() -> int:
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_packed_documents_attend_only_inside_themselves(hf_job):
    """forge's Hugging Face model (no KV cache) on a packed row with positions restarting at
    each document gives each document's own logits, as if it were alone."""
    from forge.build import ParallelPlan
    from forge.models import hf_meta_model

    _, directory, _ = hf_job
    cfg = load_config({"model": {"hf": directory}, "parallelism": {"data": "none"}})
    model = ParallelPlan.from_config(cfg, None).parallelize(
        hf_meta_model(directory), device="cpu", seed=0, weights=directory
    )
    tokens = torch.randint(4, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    documents = [(0, 4), (4, 10), (10, 16)]
    positions = torch.cat([torch.arange(b - a) for a, b in documents]).expand(2, -1)
    with torch.no_grad():
        packed = model(tokens, position_ids=positions).logits
        alone = torch.cat([model(tokens[:, a:b]).logits for a, b in documents], dim=1)
        crossing = model(tokens).logits
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (crossing[:, 4:] - alone[:, 4:]).abs().max() > 1e-2  # the check can fail


@needs_datasets
def test_sft_loss_is_the_hand_masked_loss_of_a_two_turn_conversation(hf_job, tmp_path):
    """``data.mode = "sft"``: forge's step loss on a padded row equals the cross entropy over
    the two assistant answers alone, found here by rendering the template by hand."""
    from forge.build import ParallelPlan
    from forge.kinds import model_kind
    from forge.models import hf_meta_model
    from forge_core.training import forward_backward
    from transformers import AutoTokenizer

    _, directory, _ = hf_job
    turns = [
        {"role": "user", "content": "hello what is the sky"},
        {"role": "assistant", "content": "the sky is blue"},
        {"role": "user", "content": "and the sun"},
        {"role": "assistant", "content": "the sun is big and red"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": turns}) + "\n")
    data = {"path": str(path), "mode": "sft", "packing": False, "cache_dir": str(tmp_path)}
    cfg = load_config(
        {
            "model": {"hf": directory},
            "parallelism": {"data": "none"},
            "data": data,
            "training": {"global_batch_size": 1, "seq_len": 40, "out_dir": str(tmp_path)},
        }
    )
    batch = model_kind(cfg).data(0, 1, image_token_id=None, image_tokens=0).batch(0)
    model = ParallelPlan.from_config(cfg, None).parallelize(
        hf_meta_model(directory), device="cpu", seed=0, weights=directory
    )
    loss_sum, count = forward_backward(
        model, batch.tokens, mesh=None, positions_BS=batch.positions, loss_mask_BS=batch.loss_mask
    )

    tokenizer = AutoTokenizer.from_pretrained(directory)
    render = lambda m, prompt=False: tokenizer.apply_chat_template(  # noqa: E731
        m, tokenize=True, add_generation_prompt=prompt, return_dict=False
    )
    full = list(render(turns))
    answers = set()
    for k in (1, 3):
        start, end = len(render(turns[:k], True)), len(render(turns[: k + 1]))
        answers |= set(range(start, end))
    assert full == batch.tokens[0, : len(full)].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([full[:-1]])).logits[0]
    targets = torch.tensor([t if i + 1 in answers else -100 for i, t in enumerate(full[1:])])
    by_hand = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    assert int(count) == len(answers) == int((targets != -100).sum())
    torch.testing.assert_close(loss_sum, by_hand, rtol=1e-6, atol=1e-6)


def _bad_dirs(root: Path, model: str, docs: str) -> dict[str, tuple[list[str], str]]:
    """Bad inputs -> (the --set overrides, a phrase the one-line refusal must hold)."""
    import shutil

    no_config = root / "no_config"
    shutil.copytree(model, no_config, dirs_exist_ok=True)
    (no_config / "config.json").unlink()
    no_weights = root / "no_weights"
    shutil.copytree(model, no_weights, dirs_exist_ok=True)
    (no_weights / "model.safetensors").unlink()
    other = root / "other_shape"
    shutil.copytree(model, other, dirs_exist_ok=True)
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(config))
    small = root / "small_vocab"
    shutil.copytree(model, small, dirs_exist_ok=True)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 32
    (small / "config.json").write_text(json.dumps(config))
    (root / "no_text.jsonl").write_text(json.dumps({"body": "the cat"}) + "\n")
    (root / "empty.jsonl").write_text("")
    (root / "chat.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    no_template = root / "no_template"
    make_tokenizer(no_template, chat_template=False)
    return {
        "no config.json": ([f"model.hf={no_config}"], "has no config.json"),
        "no weights": ([f"model.hf={no_weights}"], "holds no safetensors weights"),
        "weights of another shape": ([f"model.hf={other}"], "have another shape"),
        "tokenizer larger than the vocabulary": (
            [f"model.hf={small}", "model.pretrained=false", f"data.path={docs}"],
            "more than",
        ),
        "no text field": ([f"model.hf={model}", f"data.path={root / 'no_text.jsonl'}"], "text"),
        "empty dataset": ([f"model.hf={model}", f"data.path={root / 'empty.jsonl'}"], "empty"),
        "chat without a template": (
            [
                f"model.hf={model}",
                f"data.path={root / 'chat.jsonl'}",
                "data.mode=sft",
                f"data.tokenizer={no_template}",
            ],
            "chat template",
        ),
    }


@pytest.mark.zoo  # NOTE: seven CLI launches (~50 s): the Hugging Face lane
@needs_datasets
def test_bad_hf_inputs_are_one_line_before_any_rank_starts(hf_job, tmp_path):
    import subprocess
    import sys

    _, model, docs = hf_job
    for name, (overrides, phrase) in _bad_dirs(tmp_path, model, docs).items():
        sets = [
            a for o in [*overrides, f"training.out_dir={tmp_path / 'run'}"] for a in ("--set", o)
        ]
        done = subprocess.run(
            [sys.executable, "-m", "forge.cli", "train", "--nproc", "1", *sets],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [line for line in done.stderr.splitlines() if line.startswith("forge train:")]
        assert done.returncode == 2, (name, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (name, done.stderr[-2000:])
        assert lines and phrase in lines[0], (name, lines, done.stderr[-1500:])
        assert not (tmp_path / "run" / "checkpoints").exists(), name


def test_compile_of_a_tensor_parallel_hf_model_is_refused_in_both_entry_points(
    run_on_ranks, hf_job
):
    """torch.compile on a Hugging Face model under TP gave a 22 % gradient-norm error at step 1
    (FSDP2 x TP) or failed in backward: refused before launch and by ParallelPlan itself."""
    from forge.checks import config_problems

    _, directory, _ = hf_job
    cfg = load_config(
        {"model": {"hf": directory}, "parallelism": {"tp": 2}, "training": {"compile": True}}
    )
    assert any("torch.compile on a Hugging Face model" in p for p in config_problems(cfg, 4))
    tp1 = load_config(
        {"model": {"hf": directory}, "parallelism": {"tp": 1}, "training": {"compile": True}}
    )
    assert not any("torch.compile" in p for p in config_problems(tp1, 4))
    assert run_on_ranks(2, _compiled_tp_plan, directory) == ["refused"] * 2


def _compiled_tp_plan(directory: str) -> str:
    from forge.build import ParallelPlan
    from forge.models import hf_meta_model
    from forge_core import ForgeConfigError
    from forge_mesh import build_device_mesh

    mesh = build_device_mesh({"tp": 2, "dp_shard": 1}, device_type="cpu")
    plan = ParallelPlan(mesh, data="none", compile_model=True)
    try:
        plan.parallelize(hf_meta_model(directory), device="cpu", seed=0)
    except ForgeConfigError as err:
        assert "tp=2" in str(err)
        return "refused"
    return "ran"


@pytest.mark.slow
@pytest.mark.parametrize("pretrained", [True, False])
def test_forge_build_checks_an_hf_directory_against_one_device(run_on_ranks, hf_job, pretrained):
    """``forge build`` with ``[model] hf``: FSDP2 x TP with AC matches one device, from the
    directory's weights or from random weights of its config (``pretrained = false``)."""
    from forge.job import run_build

    root, directory, _ = hf_job
    cfg = {
        "model": {"hf": directory, "pretrained": pretrained},
        "parallelism": {"dp_shard": 2, "tp": 2},
        "training": {"steps": 3, "ac_mode": "full", "out_dir": str(root / "build")},
    }
    reports = run_on_ranks(4, run_build, cfg, "cpu")
    assert all(r.passed for r in reports), reports[0].text
    assert "PASS" in reports[0].text and "Hugging Face model" in reports[0].text


def _moe_dir(root: Path, family: str) -> str:
    """A tiny Hugging Face MoE model (4 experts, top-2), saved with save_pretrained."""
    import transformers

    sizes = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64}
    sizes.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **sizes, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(root / family)
    return make_tokenizer(root / family)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), [("qwen3_moe", {"ep": 2}), ("mixtral", {"tp": 2})])
def test_an_hf_moe_from_random_init_converts_and_matches_one_device(
    run_on_ranks, tmp_path, family, layout
):
    """``[model] hf`` of an MoE directory with ``pretrained = false``: its MoE blocks are
    converted to forge's under ep or tp and filled with the values the unconverted blocks
    would get from the seed (before, the converted experts kept uninitialized memory: NaN), so
    the parallel run matches one device from step 1; ``[moe]`` comes from config.json."""
    from forge.job import run_build

    directory = _moe_dir(tmp_path, family)
    cfg = {
        "model": {"hf": directory, "pretrained": False},
        "parallelism": layout,
        "training": {"steps": 3, "out_dir": str(tmp_path / "build")},
    }
    assert load_config(cfg).routed_experts == 4
    reports = run_on_ranks(4, run_build, cfg, "cpu")
    assert all(r.passed for r in reports), reports[0].text


@needs_datasets
@pytest.mark.zoo  # NOTE: a 4-rank MoE run, an export and two from_pretrained: the HF lane
def test_an_hf_moe_fine_tuned_under_ep_matches_transformers_and_goes_back(
    run_on_ranks, hf_job, tmp_path
):
    """Qwen3-MoE from its directory on the jsonl documents, ep 2 within dp_shard 4 (forge
    carves ep out of the data-parallel ranks: 2-way expert FSDP x ep 2; MoE blocks converted
    to forge's, experts stacked as read): every step's loss and gradient norm equal
    a plain transformers loop; the export writes the experts back one by one under the
    source's names, and from_pretrained gives the trained model's logits."""
    from forge_checkpoint import hf_weight_shapes
    from transformers import AutoModelForCausalLM

    _, _, documents = hf_job
    directory = _moe_dir(tmp_path, "qwen3_moe")
    cfg = _cfg(tmp_path, directory, documents, "run", dp_shard=4, ep=2)
    cfg["checkpoint"]["export_hf"] = True
    del cfg["metrics"]
    reference, _, model = _reference_steps(cfg)
    summary = run_on_ranks(4, run_train, cfg, "cpu")[0]
    assert len(summary.steps) == STEPS
    for record, (loss, norm) in zip(summary.steps, reference, strict=True):
        assert _rel(record.loss, loss) <= 1e-4 and _rel(record.grad_norm, norm) <= 1e-4
    exported = Path(summary.hf_exports[-1])
    assert hf_weight_shapes(exported) == hf_weight_shapes(directory)  # experts one by one
    loaded = AutoModelForCausalLM.from_pretrained(exported)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(tokens).logits, model(tokens).logits, rtol=1e-3, atol=1e-4
        )


@needs_datasets
def test_data_path_may_be_a_saved_dataset_directory(tmp_path):
    """A ``save_to_disk`` folder passes the launcher's path check (it is a directory, not a
    file); another folder, or a DatasetDict's, is one line saying what to give."""
    import datasets
    from forge.checks import path_problems

    rows = datasets.Dataset.from_dict({"text": ["the cat", "a dog"]})
    rows.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"train": rows}).save_to_disk(tmp_path / "splits")
    (tmp_path / "plain").mkdir()

    def problems(path: Path) -> list[str]:
        cfg = load_config({"data": {"path": str(path)}, "training": {"out_dir": str(tmp_path)}})
        return [p for p in path_problems(cfg, "train") if p.startswith("data.path")]

    assert problems(tmp_path / "saved") == []
    assert "give one split's folder" in problems(tmp_path / "splits")[0]
    assert "not a dataset saved by" in problems(tmp_path / "plain")[0]
