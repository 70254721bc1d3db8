"""docs/huggingface.md runs as shown, in order, in one folder: its setup block, the config file
it shows, every command it marks ``<!-- doc-block: walkthrough -->`` (``uv run forge ...`` run
as ``python -m forge.cli ...``), and finally the ``from_pretrained`` block on the exported
folder, whose output must be what the page shows. The report lines the page quotes must
appear in ``forge train``'s output (``...`` reads as anything)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

PAGE = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


def _fences() -> list[tuple[str, str, str]]:
    """(language, code, the text between the previous fence and this one)."""
    text = PAGE.read_text()
    found, end = [], 0
    for m in FENCE.finditer(text):
        found.append((m.group(1), m.group(2), text[end : m.start()]))
        end = m.end()
    return found


def _shown_matches(shown: str, output: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in shown.split("..."))
    return re.search(pattern, output) is not None


def _run(args: list[str], cwd: Path, *, stdout_only: bool = False) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done.stdout if stdout_only else done.stdout + done.stderr


def test_the_huggingface_page_runs_in_order(tmp_path):
    pytest.importorskip("datasets")
    fences = _fences()
    python = [code for lang, code, _ in fences if lang == "python"]
    assert len(python) == 2, "the page's setup block and its from_pretrained block"
    _run([sys.executable, "-c", python[0]], tmp_path)
    config = next(code for lang, code, _ in fences if lang == "toml")
    name = config.splitlines()[0].removeprefix("# ").strip()
    (tmp_path / name).write_text(config)
    commands = [
        line
        for lang, code, before in fences
        if lang == "bash" and "doc-block: walkthrough" in before
        for line in code.splitlines()
        if line.strip()
    ]
    assert [c.split()[:3] for c in commands] == [
        ["uv", "run", "forge"],
        ["uv", "run", "forge"],
        ["uv", "run", "forge"],
    ]
    outputs = []
    for command in commands:
        args = shlex.split(command)[3:]
        outputs.append(_run([sys.executable, "-m", "forge.cli", *args], tmp_path))
    # the report lines the page quotes after the train command
    quoted = next(
        code for lang, code, before in fences if lang == "" and "The report ends with" in before
    )
    for line in quoted.splitlines():
        assert _shown_matches(line, outputs[0]), (line, outputs[0][-2000:])
    assert (tmp_path / "runs/finetune/plots/loss.png").is_file()
    assert list((tmp_path / "runs/finetune/tensorboard").iterdir())
    printed = _run([sys.executable, "-c", python[1]], tmp_path, stdout_only=True)
    shown = [code for lang, code, before in fences if lang == "" and "It prints" in before]
    assert printed.strip().splitlines()[-1] == shown[-1].strip()
