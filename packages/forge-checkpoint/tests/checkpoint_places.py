"""File-system places the checkpoint tests need (what a test needs the machine to refuse);
the integration tests import them from here too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def read_only_dir(tmp_path: Path) -> Path:
    """A folder this process cannot create files in: mode 0o555, or for root (whom mode bits do
    not stop) sysfs, which takes no new files."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    if not os.path.ismount("/sys"):
        pytest.skip("root without /sys mounted: no folder here that refuses root's writes")
    return Path("/sys")
