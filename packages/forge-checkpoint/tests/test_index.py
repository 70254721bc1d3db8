"""Nothing read from a checkpoint's DCP index (``.metadata``, a pickle) can run code.

The reader admits an allow-list of exact ``(module, name)`` globals. A payload is planted
through every dotted path reachable from every module the allow-list names (pickle protocol 4
resolves ``a.b.c`` as an attribute chain: ``...metadata.os.system`` ran on main): none may
resolve, and none may run (a marker file the payload would create must never appear). The same
payloads run through plain ``pickle`` do create it, so the test can tell.
"""

from __future__ import annotations

import importlib
import io
import pickle
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from forge_checkpoint.files import CheckpointDamaged
from forge_checkpoint.index import (
    RefusedPickle,
    SafeFileSystemReader,
    _allowed,
    _MetadataUnpickler,
    load_index,
    model_shapes,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: Callables that run a command or code, each with the argument that makes it create the
#: marker: a shell command, a Python expression, an argv.
_RUNNERS = {
    "system": "shell",
    "popen": "shell",
    "getoutput": "shell",
    "getstatusoutput": "shell",
    "exec": "script",
    "eval": "expression",
    "compile": "expression",
    "__import__": "expression",
    "loads": "pickle",
    "load": "pickle",
    "run": "argv",
    "call": "argv",
    "check_call": "argv",
    "check_output": "argv",
    "Popen": "argv",
    "execv": "argv",
    "spawnv": "argv",
}


def _payload(module: str, name: str, arg: object) -> bytes:
    """A protocol-4 pickle: ``module``'s global ``name`` (dotted: an attribute chain), called
    with ``arg`` (bytes: an argument already pickled by :func:`_pickled`)."""
    raw = [text.encode() for text in (module, name)]
    return b"".join(
        [
            b"\x80\x04",
            *(b"X" + len(r).to_bytes(4, "little") + r for r in raw),  # BINUNICODE
            b"\x93",  # STACK_GLOBAL
            arg if isinstance(arg, bytes) else _pickled(arg),
            b"\x85R.",  # TUPLE1, REDUCE, STOP
        ]
    )


def _pickled(arg: object) -> bytes:
    """``arg`` as pickle opcodes to splice into a payload (no PROTO, FRAME or STOP)."""
    return pickle.dumps(arg, protocol=3)[2:-1]


def _args(marker: Path) -> dict[str, object]:
    script = f"''':'\ntouch {marker}\n':'''\nopen({str(marker)!r}, 'w').close()\n"
    return {
        # NOTE: a shell and Python at once: sh runs `:`, touch, `:`; Python sees a string, then open
        "shell": script,
        "script": script,
        "expression": f"__import__('pathlib').Path({str(marker)!r}).touch()",
        "pickle": _payload("builtins", "exec", _pickled(script)),
        "argv": ["sh", "-c", f"touch {marker}"],
    }


def _reachable(module: types.ModuleType, depth: int = 3) -> set[str]:
    """Every dotted attribute path from ``module``: its attributes, theirs, and on through
    modules to ``depth`` (``os.system``, ``torch.os.path.os.system``, ``pickle.loads``)."""
    paths: set[str] = set()
    frontier: list[tuple[str, object]] = [("", module)]
    for level in range(depth):
        deeper = []
        for prefix, obj in frontier:
            try:
                names = list(vars(obj))
            except TypeError:
                names = dir(obj)
            for name in names:
                path = f"{prefix}.{name}" if prefix else name
                paths.add(path)
                if level == depth - 1:
                    continue
                try:
                    value = getattr(obj, name)
                except Exception:  # a property that raises (quantized dtypes' is_signed)
                    continue
                if level == 0 or isinstance(value, types.ModuleType):
                    deeper.append((path, value))
        frontier = deeper
    return paths


#: Chains through dunder attributes that the attribute walk above does not list.
_GADGETS = (
    "__builtins__.eval",
    "__builtins__.exec",
    "__loader__.exec_module",
    "__spec__.loader.load_module",
    "__class__.__subclasses__",
    "Metadata.__init__.__globals__",
    "Size.__class__.__call__",
    "os.system",
    "os.popen",
    "subprocess.run",
    "torch.os.system",
    "sys.modules",
)


@pytest.fixture(scope="module")
def reachable() -> dict[str, set[str]]:
    modules = sorted({module for module, _ in _allowed()})
    assert "torch.distributed.checkpoint.metadata" in modules and "torch" in modules
    with warnings.catch_warnings():  # deprecated attributes warn when read
        warnings.simplefilter("ignore")
        return {m: _reachable(importlib.import_module(m)) | set(_GADGETS) for m in modules}


def test_no_dotted_path_of_an_allowed_module_resolves_or_runs(reachable, tmp_path):
    marker = tmp_path / "pwned"
    args = {kind: _pickled(arg) for kind, arg in _args(marker).items()}
    for module, name in [("os", "system"), ("builtins", "exec")]:  # the payloads do work
        pickle.loads(_payload(module, name, args["shell"]))
        assert marker.exists(), f"the {module}.{name} payload did not run unrestricted"
        marker.unlink()
    allowed = _allowed()
    planted, resolved, ran = 0, [], []
    for module, paths in reachable.items():
        for path in paths:
            if (module, path) in allowed:  # the exact names DCP's index is made of
                assert "." not in path
                continue
            last = path.rsplit(".", 1)[-1]
            for kind in {"shell", _RUNNERS.get(last, "shell")}:
                planted += 1
                try:
                    _MetadataUnpickler(io.BytesIO(_payload(module, path, args[kind]))).load()
                except RefusedPickle as refused:
                    if f"refers to {module}.{path}," in str(refused):
                        continue
                except Exception:  # NOTE: it resolved, and calling it with this argument failed
                    pass
                resolved.append(f"{module}.{path}")
            if marker.exists():
                ran.append(f"{module}.{path}")
                marker.unlink()
    assert not resolved and not ran, (len(resolved), sorted(resolved)[:5], ran[:5])
    assert planted > 100_000, planted  # torch alone: hundreds of thousands of paths
    # Through the reader's entry point too (and the one line it gives), for the gadgets.
    for module in reachable:
        for path in _GADGETS:
            with pytest.raises(CheckpointDamaged, match=r"^step-1: checkpoint metadata refers"):
                load_index(io.BytesIO(_payload(module, path, args["shell"])), "step-1")
    assert not marker.exists()


def test_the_allow_list_is_exact_names_only_and_a_real_index_still_loads(tmp_path):
    allowed = _allowed()
    assert all("." not in name and module for module, name in allowed)
    assert ("torch.distributed.checkpoint.metadata", "os") not in allowed
    assert allowed[("torch", "float32")] is torch.float32
    unpickler = _MetadataUnpickler(io.BytesIO(b""))
    for module, name in [
        ("torch.distributed.checkpoint.metadata", "os.system"),
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
        ("torch", "float32.__class__"),
        ("torch", "load"),
        ("posix", "system"),
    ]:
        with pytest.raises(RefusedPickle):
            unpickler.find_class(module, name)
    path = _saved(tmp_path)
    metadata = SafeFileSystemReader(path).read_metadata()
    assert set(metadata.state_dict_metadata) == {"model.weight", "model.bias"}
    assert model_shapes(path) == {"weight": (3, 4), "bias": (3,)}


def test_a_pickle_cannot_set_attributes_of_an_admitted_class():
    from torch.distributed.checkpoint.metadata import Metadata

    # GLOBAL Metadata, then BUILD (state None, slot state {"evil": 1}): setattr on the class
    raw = _payload("torch.distributed.checkpoint.metadata", "Metadata", None)
    raw = raw[: raw.index(b"\x93") + 1] + b"N}X\x04\x00\x00\x00evilK\x01s\x86b."
    with pytest.raises(RefusedPickle, match="sets attributes of Metadata"):
        load_index(io.BytesIO(raw), "step-1")
    assert not hasattr(Metadata, "evil")  # put back


def _saved(tmp_path: Path) -> Path:
    model = nn.Linear(4, 3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    return tmp_path


@pytest.mark.parametrize(
    "damage",
    ["truncated", "empty", "garbage", "a list", "path outside", "chunk outside"],
)
def test_a_damaged_index_is_one_line(tmp_path, damage):
    path = _saved(tmp_path)
    index = path / ".metadata"
    raw = index.read_bytes()
    if damage == "truncated":
        index.write_bytes(raw[: len(raw) // 2])
    elif damage == "empty":
        index.write_bytes(b"")
    elif damage == "garbage":
        index.write_bytes(b"\x80\x04not a pickle at all" * 10)
    elif damage == "a list":
        index.write_bytes(pickle.dumps([1, 2, 3]))
    else:
        metadata = SafeFileSystemReader(path).read_metadata()
        if damage == "path outside":
            for info in metadata.storage_data.values():
                info.relative_path = "../../etc/passwd"
        else:
            metadata.state_dict_metadata["model.bias"].chunks[0].sizes = torch.Size([9])
        index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointDamaged) as err:
        SafeFileSystemReader(path).read_metadata()
    line = str(err.value)
    assert line.startswith(f"{path.name}: .metadata ") and "\n" not in line, line
