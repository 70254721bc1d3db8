"""Opt-in patches for Hugging Face transformers that remove per-layer host syncs in training.

**The packed-sequence check.** For a batch of one sequence with ``position_ids`` and no
attention mask, transformers' flash-attention path (``_flash_attention_forward`` in
``transformers.modeling_flash_attention_utils``) asks ``_is_packed_sequence(position_ids, 1)``
whether several sequences were packed into the one row (position ids restarting at 0). The
answer is a 0-dim tensor, and ``if <tensor>:`` reads it on the host (``aten::is_nonzero`` ->
``_local_scalar_dense``): the CPU waits for the GPU once per attention layer per forward, which
stalls the launch queue and serialises compute with communication.

When you *know* your sequences are not packed, the answer is always False, and
:func:`patch_is_packed_sequence` replaces the check by a function returning the Python ``False``
(no tensor, no sync).

.. warning::
   **Do NOT use this with packed sequences** (several documents in one row, ``position_ids``
   that go back to 0 in the middle of a row). With the patch transformers no longer notices the
   packing and runs plain causal attention over the whole row: tokens attend across document
   boundaries and the loss is silently wrong. The patch is process-wide (it replaces a module
   attribute of transformers) and so applies to every model in the process until
   :func:`unpatch_is_packed_sequence` restores the original.

transformers is imported only when a function here is called, never at import time, and
everything is a no-op returning False when transformers (or the checked function, in versions
that do not have it) is absent.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch.nn as nn

__all__ = [
    "is_hf_model",
    "is_packed_sequence_patched",
    "no_packed_sequence_sync",
    "patch_is_packed_sequence",
    "unpatch_is_packed_sequence",
]

_MODULE = "transformers.modeling_flash_attention_utils"
_ATTR = "_is_packed_sequence"
_lock = threading.Lock()
#: The function the patch replaced, while the patch is in place.
_original: Callable[..., Any] | None = None


def _never_packed(position_ids: Any, batch_size: int) -> bool:
    """forge's stand-in for transformers' ``_is_packed_sequence``: sequences are never packed.

    Returns the Python ``False``, so ``if _is_packed_sequence(...)`` reads nothing on the host.
    """
    return False


def _flash_utils() -> ModuleType | None:
    """transformers' flash-attention utilities module, or None when transformers is absent."""
    try:
        return importlib.import_module(_MODULE)
    except ImportError:
        return None


def is_packed_sequence_patched() -> bool:
    """Whether transformers' packed-sequence check is currently forge's always-False stand-in.

    Does not import transformers: if it is not imported yet, nothing can be patched.
    """
    module = sys.modules.get(_MODULE)
    return module is not None and getattr(module, _ATTR, None) is _never_packed


def patch_is_packed_sequence() -> bool:
    """Make transformers' ``_is_packed_sequence`` return the Python ``False`` (no host sync).

    Returns True when the patch is in place after the call (applied now, or already by an earlier
    call: calling twice is harmless and keeps the first original), False when there is nothing to
    patch (transformers not installed, or this version has no ``_is_packed_sequence``).

    **Only for sequences that are not packed**; see this module's docstring for why packed
    sequences then train on silently wrong attention. Undo with :func:`unpatch_is_packed_sequence`.
    """
    global _original
    module = _flash_utils()
    if module is None or not callable(getattr(module, _ATTR, None)):
        return False
    with _lock:
        current = getattr(module, _ATTR)
        if current is not _never_packed:
            _original = current
            setattr(module, _ATTR, _never_packed)
    return True


def unpatch_is_packed_sequence() -> bool:
    """Put transformers' own ``_is_packed_sequence`` back; returns whether it was restored.

    False when the patch is not in place (never applied, already undone, transformers absent).
    NOTE: if something else replaced the attribute after forge did, it is left alone: restoring
    our saved original would silently drop that other patch.
    """
    global _original
    module = sys.modules.get(_MODULE)
    with _lock:
        if module is None or _original is None or getattr(module, _ATTR, None) is not _never_packed:
            return False
        setattr(module, _ATTR, _original)
        _original = None
    return True


@contextmanager
def no_packed_sequence_sync() -> Iterator[bool]:
    """Patch transformers' packed-sequence check inside the block (see :func:`patch_is_packed_sequence`).

    Yields whether the patch is in effect. On exit it restores the original only if this block
    applied the patch, so nested blocks and an earlier process-wide patch keep working.
    **Do NOT use with packed sequences.**
    """
    already = is_packed_sequence_patched()
    active = patch_is_packed_sequence()
    try:
        yield active
    finally:
        if active and not already:
            unpatch_is_packed_sequence()


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is a ``transformers.PreTrainedModel``.

    NOTE: checked without importing transformers: a PreTrainedModel instance can only exist once
    ``transformers.modeling_utils`` has been imported, so when it is not in ``sys.modules`` the
    answer is False (and importing transformers here would cost seconds for nothing).
    """
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling_utils, "PreTrainedModel", None)
    if base is None:
        return False
    return any(isinstance(m, base) for m in model.modules())
