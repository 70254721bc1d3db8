"""Export the reference Transformer to Hugging Face Llama, and safetensors files.

- :func:`to_hf_llama` / :func:`from_hf_llama` rename a full (unsharded) state dict between forge's
  module names and ``LlamaForCausalLM``'s. Both use rotate-half RoPE, so q/k need no permutation:
  tensors are passed through unchanged (not copied). A tied head maps to a head entry sharing the
  embedding's tensor, as ``state_dict()`` gives on both sides; an HF checkpoint may omit it.
- :func:`hf_llama_config` builds the matching ``transformers.LlamaConfig``; transformers is
  imported there only (it is optional).
- :func:`save_safetensors` / :func:`load_safetensors`: one consolidated file. Entries sharing a
  tensor are stored once; the other names are recorded in the ``forge.aliases`` metadata and
  restored on load as the same tensor (HF ignores it and re-ties its head itself).
- :func:`export_hf_llama`: ``model.safetensors`` + ``config.json`` for ``from_pretrained``.
- :func:`check_output`: whether a path can take an export, decided before any tensor is read:
  it must be writable, of the right kind (file or folder), and never a file forge did not write.

MoE configs are refused: HF Llama has no MoE block.

Notable choices: every file is written under a temporary name and renamed into place, so an
interrupted export leaves no half file at the output path. A file forge writes carries
``forge.writer`` in its safetensors metadata; an HF export's ``model.safetensors`` also records
the sha256 of the ``config.json`` written beside it. Only a file so marked (and, for
``config.json``, unchanged since) is overwritten; anything else at an output path is refused.
torch is imported by the functions that need it, so :func:`check_output` costs no torch import.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge_core import ForgeConfigError, ModelConfig

from .hf_weights import safetensors_header

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "HF_FILES",
    "check_output",
    "export_hf_llama",
    "from_hf_llama",
    "hf_llama_config",
    "load_safetensors",
    "save_safetensors",
    "to_hf_llama",
]

_ALIASES_KEY = "forge.aliases"
#: The safetensors metadata that marks a file as forge's (see the module docstring).
_WRITER_KEY, _WRITER = "forge.writer", "forge_checkpoint.export"
_CONFIG_SHA_KEY = "forge.config_sha256"
#: What :func:`export_hf_llama` writes into its folder (and nothing else).
HF_FILES = ("model.safetensors", "config.json")
#: The record of the files an export of a Hugging Face model wrote (name -> SHA-256), beside
#: them (:mod:`forge_checkpoint.hf_export`): what it may overwrite on the next export.
EXPORT_MANIFEST = ".forge-export.json"
_EMBED = ("tok_embeddings.weight", "model.embed_tokens.weight")
_HEAD = ("output.weight", "lm_head.weight")
_BLOCK = (  # forge suffix, HF suffix, within block i
    ("attention_norm.weight", "input_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
)


def _check_dense(config: ModelConfig) -> None:
    if config.custom_ffn_layers:
        raise ForgeConfigError(
            f"model config has MoE blocks {list(config.custom_ffn_layers)} "
            "but Hugging Face Llama has no MoE layer: export a dense model (moe_every=0)"
        )


def _name_table(config: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(forge name, HF name, shape)`` for every entry of a dense model's state dict."""
    # ModelConfig.__post_init__ fills the defaults of the optional sizes
    assert config.ffn_dim is not None and config.n_kv_heads is not None
    d, f, v, kv = config.dim, config.ffn_dim, config.vocab_size, config.n_kv_heads * config.head_dim
    shapes = [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (f, d), (f, d), (d, f)]
    table: list[tuple[str, str, tuple[int, ...]]] = [(*_EMBED, (v, d))]
    for i in range(config.n_layers):
        for (ours, theirs), shape in zip(_BLOCK, shapes, strict=True):
            table.append((f"layers.{i}.{ours}", f"model.layers.{i}.{theirs}", shape))
    return [*table, ("norm.weight", "model.norm.weight", (d,)), (*_HEAD, (v, d))]


def _rename(sd: Mapping[str, Tensor], config: ModelConfig, src: int) -> dict[str, Tensor]:
    """Rename ``sd`` from side ``src`` (0 forge, 1 HF) to the other side, checking every key."""
    import torch

    _check_dense(config)
    dst, side = 1 - src, ("forge", "Hugging Face Llama")[src]
    table = _name_table(config)
    expected = {row[src] for row in table}
    head, embed = _HEAD[src], _EMBED[src]
    # Old HF checkpoints carry the RoPE inverse frequencies; both sides recompute them.
    unexpected = sorted(
        k for k in sd if k not in expected and not k.endswith("rotary_emb.inv_freq")
    )
    missing = sorted(
        k for k in expected if k not in sd and not (k == head and config.tie_embeddings)
    )
    if missing or unexpected:
        raise ForgeConfigError(
            f"{side} state dict does not match the model config: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}; pass the full (unsharded) state dict of a "
            "dense model, built with the same ModelConfig (n_layers, tie_embeddings)"
        )
    out: dict[str, Tensor] = {}
    for *names, shape in table:
        name, new = names[src], names[dst]
        if name == head and config.tie_embeddings:
            a, b = sd.get(name), sd[embed]
            if a is not None and a.data_ptr() != b.data_ptr() and not torch.equal(a, b):
                raise ForgeConfigError(
                    f"config.tie_embeddings=True but {name} differs from {embed}: build the "
                    "config with tie_embeddings=False to keep a separate head"
                )
            out[new] = out[_EMBED[dst]]  # one tensor under both names
            continue
        if tuple(sd[name].shape) != shape:
            raise ForgeConfigError(
                f"{side} tensor {name} has shape {tuple(sd[name].shape)} but the model config "
                f"gives {shape}: export with the ModelConfig the weights were trained with"
            )
        out[new] = sd[name]
    return out


def to_hf_llama(state_dict: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Rename a forge ``Transformer`` state dict (full tensors) to ``LlamaForCausalLM`` names.

    Raises :class:`ForgeConfigError` for an MoE config and for missing, unexpected or
    wrongly-shaped entries. With ``tie_embeddings``, ``lm_head.weight`` shares the embedding.
    """
    return _rename(state_dict, config, src=0)


def from_hf_llama(state_dict: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Rename a ``LlamaForCausalLM`` state dict to forge ``Transformer`` names (inverse of
    :func:`to_hf_llama`); a tied config accepts a checkpoint without ``lm_head.weight``."""
    return _rename(state_dict, config, src=1)


def hf_llama_config(config: ModelConfig) -> Any:
    """The ``transformers.LlamaConfig`` of the same shape (needs ``transformers``)."""
    _check_dense(config)
    assert config.ffn_dim is not None  # ModelConfig.__post_init__ fills it
    try:
        from transformers import LlamaConfig
    except ImportError as e:
        raise ForgeConfigError(
            "Hugging Face export needs transformers: pip install 'transformers>=4.51'"
        ) from e
    # transformers 5 folds rope_theta into rope_parameters: its typed __init__ lacks the keyword
    # but still accepts it (as transformers 4 does), so it goes in untyped.
    rope: dict[str, Any] = {"rope_theta": config.rope_theta}
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        **rope,
    )


def save_safetensors(
    state_dict: Mapping[str, Tensor],
    path: str | os.PathLike[str],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``state_dict`` to one ``.safetensors`` file (tensors moved to CPU, contiguous).

    Entries that are the same tensor (same storage, offset, shape, stride, dtype) are written
    once and recorded as aliases; other views into shared storage are copied. ``path`` is
    checked first (:func:`check_output`): a file forge did not write there is refused.
    """
    import torch
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    path = check_output(path, folder=False)

    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[str, int]] = set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.is_meta:
            raise ForgeConfigError(
                f"{name} is a {type(t).__name__} on {getattr(t, 'device', None)}, not a plain "
                "tensor with data: save a full state dict, e.g. from get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
            )
        t = t.detach()
        ptr = (str(t.device), t.untyped_storage().data_ptr())
        ident = (*ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        # A contiguous tensor owning its whole storage is written as is; anything else is packed.
        whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        t = t.cpu()
        keep = whole and ptr not in storages
        tensors[name] = t if keep else t.clone(memory_format=torch.contiguous_format)
        storages.add(ptr)
    meta = {**(metadata or {}), "format": "pt", _WRITER_KEY: _WRITER}
    if aliases:
        meta[_ALIASES_KEY] = json.dumps(aliases)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_then_rename(path, lambda tmp: save_file(tensors, os.fspath(tmp), metadata=meta))


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a ``.safetensors`` file (on CPU), restoring the aliases :func:`save_safetensors` kept."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        meta = f.metadata() or {}
        out = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    for name, target in json.loads(meta.get(_ALIASES_KEY, "{}")).items():
        out[name] = out[target]
    return out


def export_hf_llama(
    state_dict: Mapping[str, Tensor], config: ModelConfig, out_dir: str | os.PathLike[str]
) -> Path:
    """Write ``out_dir/model.safetensors`` (HF names) and ``out_dir/config.json``, loadable with
    ``transformers.LlamaForCausalLM.from_pretrained(out_dir)``; returns ``out_dir``.

    ``out_dir`` may exist: its other files are left alone, and a ``model.safetensors`` or
    ``config.json`` there that forge did not write is refused (:func:`check_output`)."""
    out = check_output(out_dir, folder=True)
    hf_state = to_hf_llama(state_dict, config)
    hf_config = hf_llama_config(config)
    # Record the weights' dtype so from_pretrained's default dtype="auto" keeps it (the field is
    # ``dtype`` in transformers 5, ``torch_dtype`` before).
    dtype_field = "dtype" if "dtype" in hf_config.to_dict() else "torch_dtype"
    setattr(hf_config, dtype_field, hf_state[_EMBED[1]].dtype)
    # NOTE: what save_pretrained writes, written here so that its hash can mark it as forge's.
    config_json = hf_config.to_json_string(use_diff=True).encode()
    sha = hashlib.sha256(config_json).hexdigest()
    save_safetensors(hf_state, out / HF_FILES[0], metadata={_CONFIG_SHA_KEY: sha})
    _write_then_rename(out / HF_FILES[1], lambda tmp: tmp.write_bytes(config_json))
    return out


def _write_then_rename(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` a temporary file beside ``path``, then rename it to ``path``; the temporary
    file (forge's own) is removed if writing fails."""
    # NOTE: a short fixed-length name: ``path``'s own name may already be at NAME_MAX.
    tmp = path.with_name(f".forge-export-{uuid.uuid4().hex[:12]}.tmp")
    try:
        write(tmp)
        # NOTE: safetensors' writer creates its file 0600; an export is for others to read, so
        # it gets an ordinary file's mode (0666 less the umask: 0644 under the usual 022).
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (``Umask:`` of
    ``/proc/self/status``); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _safetensors_metadata(path: Path) -> dict[str, Any] | None:
    """The ``__metadata__`` of a safetensors file's JSON header; None if ``path`` is not one.
    Reads the header only (8-byte length, then JSON): nothing in it can run code."""
    try:
        header = safetensors_header(path)
    except (OSError, ValueError, struct.error):
        return None
    meta = header.get("__metadata__")
    return meta if isinstance(meta, dict) else None


def _forge_wrote(path: Path) -> bool:
    """Whether ``path`` is a file forge wrote (and, for an HF ``config.json``, has not changed)."""
    if path.name == HF_FILES[1]:
        meta = _safetensors_metadata(path.with_name(HF_FILES[0])) or {}
        try:
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return False
        return sha in (meta.get(_CONFIG_SHA_KEY), _manifest_entry(path))
    meta = _safetensors_metadata(path) or {}
    # NOTE: ``forge_step`` marks the files forge export wrote before ``forge.writer`` existed.
    return meta.get(_WRITER_KEY) == _WRITER or "forge_step" in meta


def _manifest_entry(path: Path) -> str | None:
    """The SHA-256 that :data:`EXPORT_MANIFEST` beside ``path`` records for it (None: none)."""
    try:
        owned = json.loads(path.with_name(EXPORT_MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    entry = owned.get(path.name) if isinstance(owned, dict) else None
    return entry if isinstance(entry, str) else None


def _check_path_text(path: Path, name: str) -> None:
    """No NUL byte, no component over the filesystem's name limit, not over PATH_MAX."""
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ForgeConfigError(f"{name} {str(path)!r} contains a NUL byte: give a path without one")
    try:
        name_max = os.pathconf(_existing_ancestor(path), "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            raise ForgeConfigError(
                f"{name} has a name of {len(os.fsencode(part))} bytes ({part[:24]!r}...), over "
                f"this filesystem's limit of {name_max}: give a shorter name"
            )
    if len(raw) >= 4096:
        raise ForgeConfigError(f"{name} is {len(raw)} bytes long, over 4095: give a shorter path")


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the current directory at worst)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _check_writable(path: Path, name: str) -> None:
    """``path`` can be created (or replaced): its nearest existing ancestor is a writable folder.

    NOTE: probed by creating (and removing) a file there, which also catches what mode bits do
    not show: a read-only mount, or a root user refused by the filesystem.
    """
    base = _existing_ancestor(path.parent if not path.is_dir() else path)
    if not base.is_dir():
        raise ForgeConfigError(
            f"{name} {str(path)!r}: {str(base)!r} is a file, not a folder: choose another path"
        )
    probe = base / f".forge-export-{uuid.uuid4().hex[:12]}.probe"
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as e:
        raise ForgeConfigError(
            f"{name} {str(path)!r}: cannot write in {str(base)!r} ({e.strerror}): choose a "
            "writable location"
        ) from None


def check_output(path: str | os.PathLike[str], *, folder: bool, name: str = "output") -> Path:
    """``path`` as a :class:`Path` if an export can be written there; else ForgeConfigError
    naming ``name`` (e.g. ``"--out"``), the path and the fix. Reads no tensor and imports no
    torch, so a caller can check before the expensive part.

    ``folder=False``: one file; refused if it is a folder or an existing file forge did not
    write. ``folder=True``: a folder for :data:`HF_FILES`; refused if it is a file, or holds one
    of those files that forge did not write (its other files are never touched). Both: refused
    for a NUL byte, an over-long name, a symbolic link, or a location that cannot be written.
    """
    path = Path(os.fspath(path))
    _check_path_text(path, name)
    try:
        _check_kind(path, folder, name)
    except OSError as e:  # NOTE: stat refused, e.g. a parent folder without search permission
        raise ForgeConfigError(
            f"{name} {str(path)!r} cannot be looked at ({e.strerror}): choose a location you can "
            "read and write"
        ) from None
    _check_writable(path, name)
    return path


def _check_kind(path: Path, folder: bool, name: str) -> None:
    """The checks of :func:`check_output` on what is at ``path`` already."""
    shown = str(path)
    if path.is_symlink():
        raise ForgeConfigError(
            f"{name} {shown!r} is a symbolic link: give the path it points to, or a new one"
        )
    if folder and path.exists() and not path.is_dir():
        raise ForgeConfigError(
            f"{name} {shown!r} is a file, but a Hugging Face export is a folder: give a folder "
            "path (new, or one forge exported to before)"
        )
    if not folder and path.is_dir():
        raise ForgeConfigError(
            f"{name} {shown!r} is a folder, but the export is one file: give a file path such "
            f"as {str(path / 'model.safetensors')!r}"
        )
    targets = [path / f for f in HF_FILES] if folder else [path]
    for target in targets:
        if os.path.lexists(target) and (not target.is_file() or not _forge_wrote(target)):
            what = f"holds {target.name!r}, which forge did not write"
            if target == path:
                what = "exists and forge did not write it"
            raise ForgeConfigError(
                f"{name} {shown!r} {what} (forge overwrites only its own exports): choose "
                "another path, or move that file away"
            )
