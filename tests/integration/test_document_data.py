"""Packed documents for forge's own model: a token file's ``data.eos_id``, text data, and what
is refused before launch.

A token file with ``data.eos_id`` gives each window the positions and loss mask that packed
text gives (:mod:`forge.text_data`): positions restart at 0 after each EOS, and the target that
starts a document is masked. The expected values are written out by hand. Text data with
``data.tokenizer`` trains forge's reference decoder as it trains a Hugging Face model; the
tokenizer is the word-level one of tests/hf_fixtures.py, trained locally.
"""

from __future__ import annotations

import json
import math
from array import array
from pathlib import Path

import pytest
import torch
from forge import cli, load_config
from forge.checks import config_problems
from forge.cli import EXIT_CONFIG, main
from forge.data import TokenFile, document_positions
from forge.kinds import DecoderKind, model_kind
from forge.train import run_train
from forge_core import ForgeConfigError

from tests.child import cli_outcomes
from tests.hf_fixtures import WORDS, make_tokenizer

#: Text needs the optional ``datasets`` package (forge[data]), which the lent GPU machines'
#: software lacks: the tests that tokenize skip there.
needs_datasets = pytest.mark.skipif(
    __import__("importlib").util.find_spec("datasets") is None,
    reason="datasets is not installed (the forge[data] extra)",
)

RANK_PRELOAD = ["forge.text_data"]
EOS = 2

#: A token file of 25 ids, windows of seq_len 4 (5 tokens, every 4): the window's tokens ->
#: (positions, loss_mask), by hand.
FILE = [5, 6, 2, 7, 8, 9, 10, 11, 2, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 2, 22, 2, 2, 23, 24]
WINDOWS = {
    (5, 6, 2, 7, 8): ([0, 1, 2, 0], [True, True, False, True]),  # an EOS inside
    (8, 9, 10, 11, 2): ([0, 1, 2, 3], [True] * 4),  # the last token: a target, no input
    (2, 12, 13, 14, 15): ([0, 0, 1, 2], [False, True, True, True]),  # the first token
    (15, 16, 17, 18, 19): ([0, 1, 2, 3], [True] * 4),  # no EOS at all
    (19, 20, 21, 2, 22): ([0, 1, 2, 3], [True, True, True, False]),  # the last input
    (22, 2, 2, 23, 24): ([0, 1, 0, 0], [True, False, False, True]),  # an empty document
}


def _token_file(path: Path, ids: list[int]) -> str:
    path.write_bytes(array("H", ids).tobytes())
    return str(path)


def _reader(path: str, **kw) -> TokenFile:
    args = {"seq_len": 4, "global_batch": 6, "vocab_size": 32, "seed": 0, "dp_rank": 0}
    return TokenFile(path, "uint16", **{**args, "dp_size": 1, **kw})


# --------------------------------------------------------------------------- a token file's EOS
def test_token_file_positions_restart_after_each_eos_and_document_starts_are_masked(tmp_path):
    path = _token_file(tmp_path / "t.bin", FILE)
    batch = _reader(path, eos_id=EOS).batch(0)  # one step: all 6 windows, in a seeded order
    assert batch.positions is not None and batch.loss_mask is not None
    assert batch.positions.shape == batch.loss_mask.shape == (6, 4)
    assert batch.positions.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool
    seen = set()
    for row in range(6):
        window = tuple(batch.tokens[row].tolist())
        positions, loss_mask = WINDOWS[window]
        assert batch.positions[row].tolist() == positions, window
        assert batch.loss_mask[row].tolist() == loss_mask, window
        seen.add(window)
    assert seen == set(WINDOWS)
    plain = _reader(path).batch(0)  # without eos_id: no documents
    assert plain.positions is None and plain.loss_mask is None
    assert plain.tokens.equal(batch.tokens)


def test_document_positions_of_rows_without_an_eos_count_from_the_window_start():
    tokens = torch.arange(10, 19).expand(3, -1)
    positions, loss_mask = document_positions(tokens, EOS)
    assert positions.equal(torch.arange(8).expand(3, -1)) and bool(loss_mask.all())


def test_data_parallel_ranks_together_read_the_single_rank_documents(tmp_path):
    path = _token_file(tmp_path / "t.bin", FILE)
    whole = _reader(path, eos_id=EOS)
    ranks = [_reader(path, eos_id=EOS, dp_rank=r, dp_size=2) for r in (0, 1)]
    for step in (0, 1, 5):
        parts = [r.batch(step) for r in ranks]
        for name in ("tokens", "positions", "loss_mask"):
            joined = torch.cat([getattr(p, name) for p in parts])
            assert joined.equal(getattr(whole.batch(step), name)), (step, name)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, "data.eos_id=True must be an integer"), (-1, "data.eos_id=-1 must be an integer >= 0")],
)
def test_eos_id_is_a_non_negative_integer(value, expected):
    with pytest.raises(ForgeConfigError, match=expected):
        load_config({"data": {"eos_id": value}})
    assert load_config({"data": {"eos_id": 0}}).data.eos_id == 0


# --------------------------------------------------------------------------- refusals
@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """Each case in its own directory; reaching the launcher fails it."""
    monkeypatch.chdir(tmp_path)

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were launched: the input was not refused before launch")

    monkeypatch.setattr(cli, "_launch_local", launched)


def _refused(capsys, overrides: list[str], expected: str, nproc: int = 2) -> None:
    """``forge train`` with ``overrides`` exits 2 with one stderr line holding ``expected``."""
    sets = [a for o in overrides for a in ("--set", o)]
    status = main(["train", "--nproc", str(nproc), *sets])
    err = capsys.readouterr().err
    assert status == EXIT_CONFIG, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert expected in err, err


def _text(path: Path, count: int = 40) -> str:
    """``count`` short documents of the tokenizer's words, one jsonl row each."""
    with path.open("w") as f:
        for i in range(count):
            words = [WORDS[(i * 7 + k * 3) % 20] for k in range(3 + i % 9)]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str, str]:
    """``(text, tokenizer, cache_dir)``, shared by the module's tests: tokenized once."""
    root = tmp_path_factory.mktemp("documents")
    return _text(root / "d.jsonl"), make_tokenizer(root / "tok"), str(root / "cache")


def _refusals(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Bad inputs refused by the pure checks -> (overrides, a phrase of the one line)."""
    tokens = _token_file(tmp_path / "t.bin", [i % 200 for i in range(4000)])
    text = _text(tmp_path / "d.jsonl")
    pipeline = ["parallelism.pp=2", "parallelism.tp=1"]
    return {
        "eos_id without data.path": (
            ["data.eos_id=2"],
            "data.eos_id=2 marks the documents of a token file, and data.path is unset",
        ),
        "eos_id with text": (
            [f"data.path='{text}'", "data.eos_id=2"],
            "the tokenizer's own EOS ends each document of text; unset data.eos_id",
        ),
        "eos_id outside the vocabulary": (
            [f"data.path='{tokens}'", "data.eos_id=256"],
            "data.eos_id=256 is outside model.vocab_size=256",
        ),
        "text through a pipeline": (
            [*pipeline, f"data.path='{text}'"],
            "packs documents (positions restart at each document), which pipeline stages do "
            "not carry yet; set parallelism.pp=1",
        ),
        "a token file's documents through a pipeline": (
            [*pipeline, f"data.path='{tokens}'", "data.eos_id=2"],
            "with data.eos_id=2 packs documents",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "eos_id without data.path",
        "eos_id with text",
        "eos_id outside the vocabulary",
        "text through a pipeline",
        "a token file's documents through a pipeline",
    ],
)
def test_documents_are_refused_in_one_line_before_launch(no_launch, tmp_path, capsys, case):
    overrides, expected = _refusals(tmp_path)[case]
    _refused(capsys, overrides, expected)


#: Runs ``forge.cli.main`` on each argument list (tab-separated lines of stdin) in one fresh
#: interpreter, the launcher stubbed out; prints each status and stderr line count, then
#: whether torch was imported.
def test_the_document_refusals_come_before_torch_is_imported(tmp_path):
    cases = [
        ["train", "--nproc", "2", *(a for o in overrides for a in ("--set", o))]
        for overrides, _ in _refusals(tmp_path).values()
    ]
    lines, stderr = cli_outcomes(cases, tmp_path)
    assert lines == ["2 1 False"] * len(cases) + ["torch imported: False"], stderr[-2000:]


def test_context_parallelism_takes_documents(tmp_path):
    tokens = _token_file(tmp_path / "t.bin", [i % 200 for i in range(4000)])
    for data in ({"path": tokens, "eos_id": 2}, {"path": _text(tmp_path / "d.jsonl")}):
        cfg = load_config({"parallelism": {"cp": 2}, "data": data})
        assert config_problems(cfg, 2) == [], data


@needs_datasets
def test_text_for_forge_s_model_is_checked_with_its_tokenizer(no_launch, corpus, capsys):
    text, tok, _ = corpus
    _refused(capsys, [f"data.path='{text}'"], "is text: set data.tokenizer = DIR")
    cfg = load_config({"data": {"path": text, "tokenizer": tok}, "model": {"vocab_size": 32}})
    (line,) = model_kind(cfg).data_problems()  # the tokenizer's 65 tokens
    assert "has 65 tokens, more than the model's vocabulary model.vocab_size=32" in line


def test_a_vlm_still_takes_no_text(tmp_path):
    cfg = load_config(
        {"model": {"preset": "debug_vlm"}, "data": {"path": _text(tmp_path / "d.jsonl")}}
    )
    (line,) = model_kind(cfg).data_problems()
    assert line.startswith("data.path with a vision-language model")
    assert model_kind(cfg).validation_data(0, 1) is None


def test_the_train_step_keeps_positions_on_the_host(monkeypatch, tmp_path):
    """forward_backward lays out context-parallel shards from the positions on the host: the
    step hands them over as they are; the tokens and the loss mask go to the device."""
    import forge_core.training

    seen: dict = {}
    monkeypatch.setattr(
        forge_core.training,
        "forward_backward",
        lambda model, tokens, **kw: seen.update(kw, tokens=tokens) or (None, None),
    )
    path = _token_file(tmp_path / "t.bin", FILE)
    batch = _reader(path, eos_id=EOS).batch(0)
    kind = DecoderKind(load_config({"data": {"path": path, "eos_id": EOS}}))
    kind.train_step(torch.nn.Identity(), batch, None, torch.device("meta"), None)  # type: ignore[arg-type]
    assert seen["positions_BS"] is batch.positions
    assert seen["tokens"].is_meta and seen["loss_mask_BS"].is_meta


# --------------------------------------------------------------------------- training
def _cfg(tmp_path: Path, data: dict) -> dict:
    return {
        "model": {"preset": "debug"},
        "parallelism": {"dp_shard": 2},
        "data": data,
        "training": {"steps": 3, "global_batch_size": 4, "seq_len": 16, "out_dir": str(tmp_path)},
        "checkpoint": {"save_at_end": False, "resume": "none"},
    }


def _finite_steps(run_on_ranks, cfg: dict) -> list[float]:
    assert model_kind(load_config(cfg)).data_problems() == []  # the launcher's check
    losses = [s.loss for s in run_on_ranks(2, run_train, cfg, "cpu")[0].steps]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    return losses


def _run(run_on_ranks, cfg: dict) -> tuple[list[float], list[tuple[int, float]]]:
    assert model_kind(load_config(cfg)).data_problems() == []  # the launcher's check
    summary = run_on_ranks(2, run_train, cfg, "cpu")[0]
    return [s.loss for s in summary.steps], summary.validation


@needs_datasets
def test_forge_s_model_trains_on_text_with_a_tokenizer(run_on_ranks, corpus, tmp_path):
    text, tok, cache = corpus
    data = {"path": text, "tokenizer": tok, "cache_dir": cache, "validation_fraction": 0.2}
    runs = {}
    for layout in ({"dp_shard": 2}, {"cp": 2}):  # the same global batches, split two ways
        cfg = _cfg(tmp_path / str(layout), data)
        cfg["parallelism"] = layout
        cfg["metrics"] = {"validation_every": 1}
        runs[str(layout)] = _run(run_on_ranks, cfg)
    (dp_losses, dp_val), (cp_losses, cp_val) = runs.values()
    assert len(dp_losses) == 3 and all(math.isfinite(x) for x in dp_losses), dp_losses
    # step 1 and the first validation loss come before any update diverges: the documents
    # split over the cp ranks give the data-parallel run's numbers
    assert cp_losses[0] == pytest.approx(dp_losses[0], rel=1e-5)
    assert len(cp_val) == len(dp_val) == 3
    assert cp_val[0][1] == pytest.approx(dp_val[0][1], rel=1e-5)
    assert [v for _, v in cp_val] == pytest.approx([v for _, v in dp_val], rel=1e-3)


def test_forge_s_model_trains_on_a_token_file_s_documents(run_on_ranks, tmp_path):
    ids = [(i * 7919) % 251 if i % 23 else EOS for i in range(4000)]  # a document every 23
    data = {"path": _token_file(tmp_path / "t.bin", ids), "eos_id": EOS}
    _finite_steps(run_on_ranks, _cfg(tmp_path / "run", data))
