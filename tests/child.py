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
