"""Running a test helper in a fresh Python process (one that must own its process group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def json_from_child(module: str, fn: str, arg: Any, timeout: float = 300) -> Any:
    """``module.fn(arg)`` run in a child interpreter at the repository root; its JSON result.

    The child sees this process's ``sys.path`` (pytest's ``pythonpath``, which puts each layer's
    test folder there, included): a test module it imports may import a layer's test module.
    """
    code = (
        f"import json, sys; from {module} import {fn}; "
        f"print(json.dumps({fn}(json.loads(sys.argv[1]))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(arg)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: Runs ``forge.cli.main`` on each tab-separated argument line of stdin, the launcher stubbed to
#: exit: prints ``status, stderr lines, whether a traceback was printed`` per line, then whether
#: torch was imported.
_CLI_EACH = """\
import contextlib, io, sys
from forge import cli
cli._launch_local = lambda *a, **k: sys.exit("launched")
for line in sys.stdin.read().splitlines():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(line.split("\\t"))
    print(status, err.getvalue().count("\\n"), "Traceback" in err.getvalue())
print("torch imported:", "torch" in sys.modules)
"""


def cli_outcomes(cases: list[list[str]], cwd: Path) -> tuple[list[str], str]:
    """``forge`` run on each argument list of ``cases`` in one fresh interpreter in ``cwd``
    (without starting ranks): its output lines (see ``_CLI_EACH``) and its stderr."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _CLI_EACH],
        input="\n".join("\t".join(args) for args in cases),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=cwd,
        timeout=120,
    )
    return proc.stdout.splitlines(), proc.stderr
