"""forge.text_data: text files tokenized once (cached), packed or padded into rows by step.

The tokenizer (tests/hf_fixtures.py) is word-level: every word is one token, so the expected
ids, positions and loss masks are written out by hand here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from forge import text_data
from forge.job_config import DataConfig
from forge.text_cache import cache_key, cache_path
from forge.text_data import (
    TextData,
    TokenizedText,
    is_text_data,
    text_data_problems,
    tokenize_text,
)
from forge_core import ForgeConfigError

from tests.hf_fixtures import SPECIALS, TEMPLATE_WORDS, WORDS, make_tokenizer

#: Loading text needs the optional ``datasets`` package (forge[data]); the lent GPU machines'
#: software has none, so there these tests skip (the missing-package message is tested here).
needs_datasets = pytest.mark.skipif(
    __import__("importlib").util.find_spec("datasets") is None,
    reason="datasets is not installed (the forge[data] extra)",
)

VOCAB = {t: i for i, t in enumerate(SPECIALS + TEMPLATE_WORDS + WORDS)}
BOS, EOS, PAD = VOCAB["<bos>"], VOCAB["<eos>"], VOCAB["<pad>"]
DOCS = ["the cat sits", "a dog runs fast", "hello"]
CHAT = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi the cat"},
    {"role": "user", "content": "why"},
    {"role": "assistant", "content": "no"},
]


def ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.split()]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok_plain(tmp_path_factory) -> str:
    return make_tokenizer(tmp_path_factory.mktemp("tok_plain"), chat_template=False)


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def texts(path: Path, docs: list[str] = DOCS) -> Path:
    return jsonl(path, [{"text": d} for d in docs])


def load(data: DataConfig, tok: str, tmp_path: Path, split: str = "train") -> TokenizedText:
    return tokenize_text(
        data, tokenizer_dir=tok, seq_len=4, seed=0, split=split, cache_dir=str(tmp_path / "c")
    )


def source(data: DataConfig, tok: str, tmp_path: Path, **kw) -> TextData:
    args = {"seq_len": 4, "global_batch": 3, "seed": 0, "dp_rank": 0, "dp_size": 1, **kw}
    return TextData(data, tokenizer_dir=tok, cache_dir=str(tmp_path / "c"), **args)


# --------------------------------------------------------------------------- pretraining
@needs_datasets
def test_pretrain_packs_documents_each_with_bos_and_one_eos(tok, tmp_path):
    path = texts(tmp_path / "d.jsonl", [*DOCS, "", "  ", "the sun <eos>"])
    text = load(DataConfig(path=str(path)), tok, tmp_path)
    expected = (
        [BOS, *ids("the cat sits"), EOS]
        + [BOS, *ids("a dog runs fast"), EOS]
        + [BOS, *ids("hello"), EOS]
        + [BOS, *ids("the sun"), EOS]  # EOS already there: not doubled; blank rows skipped
    )
    assert text.tokens.tolist() == expected
    assert text.tokens.dtype == torch.int64
    assert text.doc_starts.tolist() == [0, 5, 11, 14]
    assert [i for i, t in enumerate(text.target_mask.tolist()) if not t] == [0, 5, 11, 14]


@needs_datasets
def test_windows_restart_positions_at_document_and_window_starts(tok, tmp_path):
    data = DataConfig(path=str(texts(tmp_path / "d.jsonl")))
    # 14 tokens: [<bos> the cat sits <eos>] [<bos> a dog runs fast <eos>] [<bos> hello <eos>]
    # seq_len 4: windows start at 0, 4, 8 (the last token of one is the first of the next).
    windows = {
        0: ([BOS, *ids("the cat sits"), EOS], [0, 1, 2, 3], [True] * 4),
        1: ([EOS, BOS, *ids("a dog runs")], [0, 0, 1, 2], [False, True, True, True]),
        2: ([*ids("runs fast"), EOS, BOS, VOCAB["hello"]], [0, 1, 2, 0], [True, True, False, True]),
    }
    batch = source(data, tok, tmp_path).batch(0)
    order = torch.randperm(3, generator=torch.Generator().manual_seed(0 * 7919 + 0)).tolist()
    assert batch.positions is not None and batch.loss_mask is not None
    assert batch.tokens.shape == (3, 5) and batch.positions.shape == batch.loss_mask.shape == (3, 4)
    assert batch.positions.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool
    for row, window in enumerate(order):
        tokens, positions, loss_mask = windows[window]
        assert batch.tokens[row].tolist() == tokens, window
        assert batch.positions[row].tolist() == positions, window
        assert batch.loss_mask[row].tolist() == loss_mask, window


@needs_datasets
def test_dp_ranks_together_read_the_single_rank_batch_at_every_step(tok, tmp_path):
    data = DataConfig(path=str(texts(tmp_path / "d.jsonl", DOCS * 3)))
    whole = source(data, tok, tmp_path, global_batch=4)
    ranks = [source(data, tok, tmp_path, global_batch=4, dp_rank=r, dp_size=2) for r in (0, 1)]
    fresh = source(data, tok, tmp_path, global_batch=4)
    assert fresh.batch(5).tokens.equal(whole.batch(5).tokens)  # a pure function of the step
    for step in range(6):  # 10 windows, 4 a step: steps cross passes over the data
        full, parts = whole.batch(step), [r.batch(step) for r in ranks]
        for name in ("tokens", "positions", "loss_mask"):
            joined = torch.cat([getattr(p, name) for p in parts])
            assert joined.equal(getattr(full, name)), (step, name)


@needs_datasets
def test_every_window_is_read_once_per_pass(tok, tmp_path):
    docs = [
        *DOCS,
        "red sun",
        "blue moon flies",
        "big tree",
        "small fish swims two",
        "green bird sings",
        "yes",
    ]
    data = DataConfig(path=str(texts(tmp_path / "d.jsonl", docs)))  # every window differs
    stream = load(data, tok, tmp_path).tokens
    assert len(stream) == 41  # 10 windows of 4 + 1
    reader = source(data, tok, tmp_path, global_batch=5)
    rows = torch.cat([reader.batch(0).tokens, reader.batch(1).tokens])
    starts = sorted(s for row in rows for s in range(0, 40, 4) if stream[s : s + 5].equal(row))
    assert starts == list(range(0, 40, 4))


# --------------------------------------------------------------------------- sft
def render(tok: str, messages: list[dict], prompt: bool) -> list[int]:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    return list(t.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False))


@needs_datasets
def test_sft_targets_are_exactly_the_assistant_tokens(tok, tmp_path):
    path = jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    full = render(tok, CHAT, False)
    # By hand, from separate renders: each assistant turn runs from the end of the prompt
    # render of the messages before it to the end of the render that includes it.
    first = full[len(render(tok, CHAT[:1], True)) : len(render(tok, CHAT[:2], False))]
    second = full[len(render(tok, CHAT[:3], True)) :]
    assert first == [*ids("hi the cat"), EOS] and second == [VOCAB["no"], EOS]
    data = DataConfig(path=str(path), mode="sft")
    batch = source(data, tok, tmp_path, seq_len=len(full) - 1, global_batch=1).batch(0)
    assert batch.tokens[0].tolist() == full
    assert batch.loss_mask is not None
    assert batch.tokens[0, 1:][batch.loss_mask[0]].tolist() == first + second


@needs_datasets
def test_sft_packing_masks_the_start_of_each_conversation(tok, tmp_path):
    other = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    path = jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": other}])
    text = load(DataConfig(path=str(path), mode="sft"), tok, tmp_path)
    a, b = render(tok, CHAT, False), render(tok, other, False)
    assert text.tokens.tolist() == a + b
    assert text.doc_starts.tolist() == [0, len(a)]
    targets = text.tokens[text.target_mask].tolist()
    assert targets == [*ids("hi the cat"), EOS, VOCAB["no"], EOS, VOCAB["yes"], EOS]


@needs_datasets
def test_padded_sft_puts_one_conversation_per_row(tok, tmp_path):
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    late = [  # its assistant turn starts past seq_len + 1 tokens: nothing to learn, left out
        {"role": "user", "content": "the cat sits on the big red tree with a dog and a bird"},
        {"role": "assistant", "content": "yes"},
    ]
    rows = [{"messages": m} for m in (CHAT, short, late)]
    data = DataConfig(path=str(jsonl(tmp_path / "c.jsonl", rows)), mode="sft", packing=False)
    seq_len = 12
    full, little = render(tok, CHAT, False), render(tok, short, False)
    assert len(full) > seq_len + 1 > len(little)
    expected = {  # tokens -> targets, by hand
        tuple(full[: seq_len + 1]): [False] * 5 + [True] * 4 + [False] * 3,
        tuple(little + [PAD] * (seq_len + 1 - len(little))): [False] * 5 + [True] * 2 + [False] * 5,
    }
    batch = source(data, tok, tmp_path, seq_len=seq_len, global_batch=2).batch(0)
    assert batch.loss_mask is not None and batch.positions is not None
    seen = set()
    for row in range(2):
        key = tuple(batch.tokens[row].tolist())
        assert key in expected, key
        assert batch.loss_mask[row].tolist() == expected[key]
        assert batch.positions[row].tolist() == list(range(seq_len))
        seen.add(key)
    assert seen == set(expected)  # one pass: both rows once, the late conversation never


# --------------------------------------------------------------------------- cache
@needs_datasets
def test_the_corpus_is_tokenized_once_and_a_changed_file_is_a_new_key(tok, tmp_path, monkeypatch):
    calls = []
    real = text_data._tokenize_corpus
    monkeypatch.setattr(
        text_data, "_tokenize_corpus", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    path = texts(tmp_path / "d.jsonl")
    data = DataConfig(path=str(path))
    first = load(data, tok, tmp_path)
    again = load(data, tok, tmp_path)
    load(DataConfig(path=str(path), validation_fraction=0.34), tok, tmp_path)
    assert len(calls) == 1
    assert again.tokens.equal(first.tokens) and again.target_mask.equal(first.target_mask)
    key = cache_key(str(path), tok, text_data._settings(data))
    cache = cache_dir_files(tmp_path)
    assert cache == [os.path.basename(cache_path(str(tmp_path / "c"), key))]  # no scratch left

    texts(path, [*DOCS, "two"])
    assert cache_key(str(path), tok, text_data._settings(data)) != key
    assert len(load(data, tok, tmp_path).doc_starts) == 4 and len(calls) == 2


def cache_dir_files(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path / "c"))


@needs_datasets
def test_a_damaged_cache_file_is_rewritten_and_other_files_are_left(tok, tmp_path, monkeypatch):
    data = DataConfig(path=str(texts(tmp_path / "d.jsonl")))
    first = load(data, tok, tmp_path)
    (name,) = cache_dir_files(tmp_path)
    (tmp_path / "c" / name).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    (tmp_path / "c" / "notes.txt").write_text("mine")
    calls = []
    real = text_data._tokenize_corpus
    monkeypatch.setattr(
        text_data, "_tokenize_corpus", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    assert load(data, tok, tmp_path).tokens.equal(first.tokens) and len(calls) == 1
    assert load(data, tok, tmp_path).tokens.equal(first.tokens) and len(calls) == 1
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- validation split
@needs_datasets
def test_the_validation_split_is_disjoint_stable_and_leaves_the_rest_to_train(tok, tmp_path):
    docs = [f"{a} {b}" for a in ("the", "a") for b in ("cat", "dog", "bird", "fish")]
    data = DataConfig(path=str(texts(tmp_path / "d.jsonl", docs)), validation_fraction=0.25)

    def documents(split: str) -> set[tuple[int, ...]]:
        text = load(data, tok, tmp_path, split)
        bounds = [*text.doc_starts.tolist(), len(text.tokens)]
        return {tuple(text.tokens[s:e].tolist()) for s, e in pairwise(bounds)}

    held, train = documents("validation"), documents("train")
    assert len(held) == 2 and len(train) == 6 and not held & train
    assert held | train == {(BOS, *ids(d), EOS) for d in docs}
    assert documents("validation") == held  # a fixed function of the seed
    with pytest.raises(ForgeConfigError, match="data.validation_fraction > 0"):
        load(DataConfig(path=data.path), tok, tmp_path, "validation")


# --------------------------------------------------------------------------- formats
def write(kind: str, tmp_path: Path) -> Path:
    from datasets import Dataset

    if kind == "jsonl":
        return texts(tmp_path / "d.jsonl")
    if kind == "txt":
        path = tmp_path / "d.txt"
        path.write_text("\n\n".join(DOCS) + "\n")  # blank lines between: not documents
        return path
    rows = Dataset.from_dict({"text": DOCS, "id": [1, 2, 3]})
    if kind == "parquet":
        rows.to_parquet(str(tmp_path / "d.parquet"))
        return tmp_path / "d.parquet"
    rows.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt", "saved"])
@needs_datasets
def test_every_format_loads_the_same_documents(tok, tmp_path, kind):
    path = write(kind, tmp_path)
    assert is_text_data(str(path))
    text = load(DataConfig(path=str(path)), tok, tmp_path)
    assert text.tokens.tolist() == [t for d in DOCS for t in (BOS, *ids(d), EOS)]


def test_a_token_file_is_not_text(tmp_path):
    assert not is_text_data(str(tmp_path / "tokens.bin"))
    assert is_text_data(str(tmp_path / "d.JSONL"))


# --------------------------------------------------------------------------- refusals
def problems(data: DataConfig, tok: str | None, tmp_path: Path, **kw) -> list[str]:
    args = {"vocab_size": 128, "seq_len": 4, "seed": 0, **kw}
    found = text_data_problems(data, tokenizer_dir=tok, cache_dir=str(tmp_path / "c"), **args)
    assert all("\n" not in p for p in found), found
    return found


@needs_datasets
def test_clean_text_has_no_problems_and_fills_the_cache(tok, tmp_path):
    data = DataConfig(path=str(texts(tmp_path / "d.jsonl")), validation_fraction=0.34)
    assert problems(data, tok, tmp_path, seq_len=2) == []
    assert len(cache_dir_files(tmp_path)) == 1


@needs_datasets
def test_each_refusal_names_the_file_or_field_and_the_fix(tok, tok_plain, tmp_path):
    good = str(texts(tmp_path / "d.jsonl"))
    chat = str(jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}]))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (DataConfig(path=str(tmp_path / "no.jsonl")), tok, {}, "does not exist; set data.path"),
        (DataConfig(path=good), None, {}, "is text: set data.tokenizer = DIR or model.hf"),
        (DataConfig(path=good), str(empty), {}, "has no tokenizer files"),
        (DataConfig(path=good, text_field="body"), tok, {}, "data.text_field='body' is not a"),
        (DataConfig(path=chat, mode="sft", messages_field="chat"), tok, {}, "its columns: ["),
        (DataConfig(path=chat, mode="sft"), tok_plain, {}, "data.mode='sft' needs a chat template"),
        (DataConfig(path=good), tok, {"vocab_size": 10}, "has 65 tokens, more than the model's"),
        (DataConfig(path=good), tok, {"seq_len": 14}, "14 tokens, fewer than one window"),
        (DataConfig(path=good, validation_fraction=0.3), tok, {}, "validation split of data.path"),
        (DataConfig(path=good, validation_fraction=0.9), tok, {}, "leaving none to train on"),
        (DataConfig(path=str(jsonl(tmp_path / "e.jsonl", [{"text": ""}] * 2))), tok, {}, "empty"),
    ]
    for data, tokenizer, kw, expected in cases:
        found = problems(data, tokenizer, tmp_path, **kw)
        assert len(found) == 1 and expected in found[0], (expected, found)
    (found,) = problems(DataConfig(path=good, text_field="body"), tok, tmp_path)
    assert "its columns: ['text']; set data.text_field" in found


@needs_datasets
def test_rows_that_are_not_conversations_and_empty_files_are_refused(tok, tmp_path):
    bad = jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "text": "hi"}]}])
    (found,) = problems(DataConfig(path=str(bad), mode="sft"), tok, tmp_path)
    assert "row 0" in found and "list of {'role', 'content'} messages" in found
    (tmp_path / "zero.jsonl").write_text("")
    (found,) = problems(DataConfig(path=str(tmp_path / "zero.jsonl")), tok, tmp_path)
    assert "zero.jsonl' is an empty file" in found


@needs_datasets
def test_a_template_that_rewrites_earlier_turns_is_refused(tok, tmp_path):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    t.chat_template = (  # drops every assistant turn but the last: not prefix-stable
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['role'] }} : {{ m['content'] }} "
        "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
    )
    t.save_pretrained(str(tmp_path / "bad_tok"))
    chat = jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    (found,) = problems(DataConfig(path=str(chat), mode="sft"), str(tmp_path / "bad_tok"), tmp_path)
    assert "is not prefix-stable" in found


def test_missing_datasets_package_is_one_line(tok, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    (found,) = problems(DataConfig(path=str(texts(tmp_path / "d.jsonl"))), tok, tmp_path)
    assert "needs the datasets package: pip install 'forge-parallel[data]'" in found


@needs_datasets
def test_loading_writes_nothing_to_the_hugging_face_cache(tok, tmp_path):
    """datasets' arrow files go to a scratch folder under the token cache, then away."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from forge.job_config import DataConfig\n"
        "from forge.text_data import tokenize_text\n"
        "t = tokenize_text(DataConfig(path=sys.argv[2]), tokenizer_dir=sys.argv[3], seq_len=4,"
        " seed=0, cache_dir=sys.argv[4])\n"
        "print(len(t.tokens))\n"
    )
    path, hf_home = texts(tmp_path / "d.jsonl"), tmp_path / "hf_home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_CACHE"))}
    env.update(HF_HOME=str(hf_home), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    root = str(Path(__file__).resolve().parents[2])
    args = [root, str(path), tok, str(tmp_path / "c")]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "14"
    assert not hf_home.exists() and not (tmp_path / "xdg").exists()
    assert [n.endswith(".safetensors") for n in cache_dir_files(tmp_path)] == [True]
