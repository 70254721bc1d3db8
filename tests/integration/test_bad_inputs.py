"""Every bad input is one line before launch: the config file, its values, the paths a run
writes and reads, and the token file.

Each case runs ``forge.cli.main`` in this process and expects exit 2 with exactly one line on
stderr naming the field (or file) and the fix. The launcher is replaced by one that fails the
test, so a refusal that comes only after launch fails at once instead of training. The refusals
that need no token file come before torch is imported (checked in one fresh interpreter).
"""

from __future__ import annotations

import errno
import os
import threading
from array import array
from pathlib import Path

import pytest
from forge import cli
from forge.checks import path_problems
from forge.cli import EXIT_CONFIG, main
from forge.config import load_config
from forge.kinds import model_kind
from forge_core import ForgeConfigError

from tests.child import cli_outcomes


@pytest.fixture(autouse=True)
def _refused_before_launch(monkeypatch, tmp_path):
    """Each case runs in its own directory (the default out_dir lands there); reaching the
    launcher fails the case."""
    monkeypatch.chdir(tmp_path)

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were launched: the input was not refused before launch")

    monkeypatch.setattr(cli, "_launch_local", launched)


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _refused(capsys, args: list[str], *expected: str) -> str:
    """``forge <args>`` exits 2 with one stderr line holding every ``expected`` text."""
    status = main(args)
    err = capsys.readouterr().err
    assert status == EXIT_CONFIG, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


# --------------------------------------------------------------------------- config files


def test_a_non_utf8_byte_in_the_config_names_the_file_and_the_offset(tmp_path, capsys):
    (tmp_path / "job.toml").write_bytes(b"[training]\n# caf\xe9\nsteps = 3\n")
    _refused(capsys, ["train", "job.toml"], "'job.toml' is not UTF-8", "0xe9 at offset 16")


def test_a_config_with_a_utf8_byte_order_mark_loads(tmp_path):
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf[training]\nsteps = 3\n")
    (tmp_path / "plain.toml").write_bytes(b"[training]\nsteps = 3\n")
    assert load_config(tmp_path / "bom.toml") == load_config(tmp_path / "plain.toml")
    assert load_config(tmp_path / "bom.toml").training.steps == 3


def test_a_fifo_as_the_config_is_named_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "job.toml"
    os.mkfifo(fifo)
    result: list[int] = []
    reader = threading.Thread(target=lambda: result.append(main(["train", str(fifo)])))
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # NOTE: it opened the FIFO: a writer that leaves at once frees it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join()
        pytest.fail("forge opened the FIFO and blocked on it")
    err = capsys.readouterr().err
    assert result == [EXIT_CONFIG] and err.count("\n") == 1, err
    assert "is a FIFO (named pipe), not a regular file" in err, err


def test_a_directory_as_the_config_is_named(tmp_path, capsys):
    (tmp_path / "job.toml").mkdir()
    _refused(capsys, ["build", "job.toml"], "'job.toml' is a directory, not a regular file")


def test_a_config_file_cannot_set_tp_allow_import(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[tp]\nplan = "my_plans:PLAN"\nallow_import = ["my_plans"]\n')
    with pytest.raises(ForgeConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"tp.allow_import cannot be set in a config file ({path}): a file cannot grant itself "
        "imports; pass --allow-import MODULE on the command line or set FORGE_ALLOW_IMPORT"
    )
    # the person running forge grants it: an override or a dict (the Python API)
    assert load_config(None, ["tp.allow_import=['my_plans']"]).tp.allow_import == ("my_plans",)
    assert load_config({"tp": {"allow_import": ["my_plans"]}}).tp.allow_import == ("my_plans",)


# --------------------------------------------------------------------------- config values

VALUES = [
    (["training.lr=inf"], "training.lr=inf must be a finite number > 0"),
    (["training.lr=nan"], "training.lr=nan must be a finite number > 0"),
    (["training.min_lr_ratio=nan"], "training.min_lr_ratio=nan must be a finite number in [0, 1]"),
    (["training.weight_decay=inf"], "training.weight_decay=inf must be a finite number >= 0"),
    (["model.norm_eps=-1"], "model.norm_eps=-1 must be a finite number in (0, 1)"),
    (["model.rope_theta=0"], "model.rope_theta=0 must be a finite number > 1"),
    (["model.ffn_dim=0"], "model.ffn_dim=0 must be a positive integer"),
    (["model.ffn_dim=-64"], "model.ffn_dim=-64 must be a positive integer"),
    (["model.dim=1099511627776"], "model.dim=1099511627776 is too large"),
    (
        ["training.global_batch_size=1099511627776"],
        "training.global_batch_size=1099511627776 is too large",
    ),
    (["training.seed=18446744073709551616"], "training.seed=18446744073709551616 is too large"),
    (
        ["model.preset=debug_moe", "moe.moe_bias_update_rate=inf"],
        "moe.moe_bias_update_rate=inf must be a finite number in [0, 1]",
    ),
    (
        ["model.preset=debug_moe", "moe.moe_bias_update_rate=1e300"],
        "moe.moe_bias_update_rate=1e+300 must be a finite number in [0, 1]",
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), VALUES, ids=[v[-1] for v, _ in VALUES])
def test_a_bad_value_is_one_line_naming_its_own_field(capsys, overrides, expected):
    err = _refused(capsys, ["train", *_sets(*overrides)], expected)
    assert err.startswith(f"forge train: config error: {expected}"), err


# --------------------------------------------------------------------------- paths


def _a_file(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("mine")
    return tmp_path / "notes.txt"


def _a_fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "pipe")
    return tmp_path / "pipe"


LONG = "a" * 300
#: case: (the field the line names, its overrides in a fresh directory, what the line says)
PATHS = {
    "NUL in training.out_dir": (
        "training.out_dir",
        lambda tmp: ['training.out_dir="ru\\u0000n"'],
        "training.out_dir='ru\\x00n' holds a NUL character",
    ),
    "NUL in checkpoint.dir": (
        "checkpoint.dir",
        lambda tmp: ['checkpoint.dir="ck\\u0000pt"'],
        "checkpoint.dir='ck\\x00pt' holds a NUL character",
    ),
    "training.out_dir is a file": (
        "training.out_dir",
        lambda tmp: [f"training.out_dir='{_a_file(tmp)}'"],
        "notes.txt' is a file, not a directory",
    ),
    "checkpoint.dir is a file": (
        "checkpoint.dir",
        lambda tmp: [f"checkpoint.dir='{_a_file(tmp)}'"],
        "notes.txt' is a file, not a directory",
    ),
    "checkpoint.dir under a file": (
        "checkpoint.dir",
        lambda tmp: [f"checkpoint.dir='{_a_file(tmp)}/ckpt'"],
        "notes.txt' is a file, not a directory",
    ),
    "a 300-character name in training.out_dir": (
        "training.out_dir",
        lambda tmp: [f"training.out_dir='{tmp}/{LONG}/run'"],
        "is 300 bytes, more than the 255 this file system allows",
    ),
    "a 300-character name in checkpoint.dir": (
        "checkpoint.dir",
        lambda tmp: [f"checkpoint.dir='{tmp}/{LONG}'"],
        "is 300 bytes, more than the 255 this file system allows",
    ),
    "NUL in data.path": (
        "data.path",
        lambda tmp: ['data.path="tok\\u0000ens.bin"'],
        "data.path='tok\\x00ens.bin' holds a NUL character",
    ),
    "data.path a directory": (  # NOTE: only a save_to_disk folder may be one
        "data.path",
        lambda tmp: [f"data.path='{tmp}'"],
        "is a directory but not a dataset saved by datasets' save_to_disk",
    ),
    "data.path a FIFO": (
        "data.path",
        lambda tmp: [f"data.path='{_a_fifo(tmp)}'"],
        "is a FIFO (named pipe), not a regular file",
    ),
}


@pytest.mark.parametrize("case", list(PATHS))
def test_a_bad_path_is_one_line_naming_its_field(tmp_path, capsys, case):
    field, overrides, expected = PATHS[case]
    err = _refused(capsys, ["train", *_sets(*overrides(tmp_path))], expected)
    assert err.startswith(f"forge train: config error: {field}="), err


def test_forge_build_refuses_an_out_dir_that_is_a_file(tmp_path, capsys):
    out = _a_file(tmp_path)
    _refused(capsys, ["build", "--set", f"training.out_dir='{out}'"], "is a file, not a directory")
    assert out.read_text() == "mine"


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES], ids=["read-only", "no permission"])
@pytest.mark.parametrize("field", ["training.out_dir", "checkpoint.dir"])
def test_an_unwritable_directory_is_one_line(tmp_path, capsys, monkeypatch, code, field):
    """The file system refuses to create anything under ``ro/`` (EROFS: read-only mount,
    EACCES: no permission; simulated, since root may write anywhere a chmod forbids)."""
    (tmp_path / "ro").mkdir()
    mkdir = os.mkdir

    def refusing_mkdir(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(code, os.strerror(code), str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refusing_mkdir)
    _refused(
        capsys,
        ["train", "--set", f"{field}='{tmp_path / 'ro' / 'run'}'"],
        f"config error: {field}=",
        f"cannot be written: {os.strerror(code)}",
    )


def test_the_write_probe_leaves_nothing_behind(tmp_path):
    (tmp_path / "existing").mkdir()
    before = sorted(tmp_path.rglob("*"))
    for out in ("existing", "new/nested/run"):
        cfg = load_config(None, [f"training.out_dir='{tmp_path / out}'"])
        assert path_problems(cfg, "train") == []
    assert sorted(tmp_path.rglob("*")) == before


# --------------------------------------------------------------------------- token files


def _tokens(path: Path, code: str, ids: list[int]) -> str:
    path.write_bytes(array(code, ids).tobytes())
    return str(path)


IDS = [(i * 7919) % 251 for i in range(4000)]  # real-looking ids of the debug vocabulary (256)
TOKENS = {
    "int64 read as the default uint16": (
        lambda tmp: [f"data.path='{_tokens(tmp / 't.bin', 'q', IDS)}'"],
        "set data.dtype = 'int64'",
    ),
    "int32 read as the default uint16": (
        lambda tmp: [f"data.path='{_tokens(tmp / 't.bin', 'i', IDS)}'"],
        "set data.dtype = 'int32'",
    ),
    "uint16 read as int64": (
        lambda tmp: [f"data.path='{_tokens(tmp / 't.bin', 'H', IDS)}'", "data.dtype='int64'"],
        "read as uint16 every id fits: set data.dtype = 'uint16'",
    ),
    "an id outside the vocabulary": (
        lambda tmp: [f"data.path='{_tokens(tmp / 't.bin', 'H', [*IDS[:3001], 300, *IDS])}'"],
        "holds token id 300 at token 3001 (data.dtype='uint16'), outside model.vocab_size=256",
    ),
    "a size that is not whole tokens": (
        lambda tmp: [f"data.path='{_tokens(tmp / 't.bin', 'B', [1] * 4001)}'"],
        "has 4001 bytes, not a multiple of 2 (data.dtype='uint16')",
    ),
    "fewer tokens than one sample": (
        lambda tmp: [f"data.path='{_tokens(tmp / 't.bin', 'H', IDS[:32])}'"],
        "holds 32 tokens of data.dtype='uint16', fewer than one sample of",
    ),
    "a token file for a vision-language model": (
        lambda tmp: ["model.preset=debug_vlm", f"data.path='{_tokens(tmp / 't.bin', 'H', IDS)}'"],
        "data.path with a vision-language model",
    ),
}


@pytest.mark.parametrize("case", list(TOKENS))
def test_a_bad_token_file_is_one_line_before_launch(tmp_path, capsys, case):
    overrides, expected = TOKENS[case]
    _refused(capsys, ["train", *_sets(*overrides(tmp_path))], expected)


def test_a_good_token_file_passes_the_check(tmp_path):
    for code, dtype in (("H", "uint16"), ("i", "int32"), ("I", "uint32"), ("q", "int64")):
        path = _tokens(tmp_path / f"{dtype}.bin", code, IDS)
        cfg = load_config(None, [f"data.path='{path}'", f"data.dtype='{dtype}'"])
        assert model_kind(cfg).data_problems() == [], dtype


# --------------------------------------------------------------------------- before torch


#: Runs ``forge.cli.main`` on each argument list (one per line of stdin, tab-separated) in one
#: fresh interpreter, the launcher stubbed out; prints each status and stderr line count, then
#: whether torch was imported.
def test_refusals_without_a_token_file_come_before_torch_is_imported(tmp_path):
    (tmp_path / "latin.toml").write_bytes(b"[training]\nsteps = 3 # \xff\n")
    (tmp_path / "allow.toml").write_text('[tp]\nallow_import = ["os"]\n')
    os.mkfifo(tmp_path / "fifo.toml")
    cases = [
        ["train", "latin.toml"],
        ["train", "allow.toml"],
        ["build", "fifo.toml"],
        *[["train", *_sets(*overrides)] for overrides, _ in VALUES],
        *[["train", *_sets(*make(tmp_path))] for _, make, _ in PATHS.values()],
    ]
    lines, stderr = cli_outcomes(cases, tmp_path)
    assert lines[:-1] == ["2 1 False"] * len(cases), lines + [stderr[-2000:]]
    assert lines[-1] == "torch imported: False"
