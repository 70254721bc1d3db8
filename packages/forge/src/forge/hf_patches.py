"""Opt-in patches for Hugging Face transformers that remove per-layer host syncs in training.

**The packed-sequence check.** For a batch of one sequence with ``position_ids`` and no
attention mask, transformers' flash-attention path (``_flash_attention_forward`` in
``transformers.modeling_flash_attention_utils``) asks ``_is_packed_sequence(position_ids, 1)``
whether several sequences were packed into the one row (position ids restarting at 0). The
answer is a 0-dim tensor, and ``if <tensor>:`` reads it on the host (``aten::is_nonzero`` ->
``_local_scalar_dense``): the CPU waits for the GPU once per attention layer per forward, which
stalls the launch queue and serialises compute with communication.

When you *know* your sequences are not packed, the answer is always False, and forge can
replace the check by a function returning the Python ``False`` (no tensor, no sync), **only while
your model runs**: :func:`skip_packed_sequence_check` hooks the model so the replacement is in
place during its forward (and during the recompute of activation checkpointing, which re-runs
each attention module), and :func:`no_packed_sequence_sync` does the same for a ``with`` block.
Nothing stays replaced between calls, and forge keeps no process-wide state.

.. warning::
   **Do NOT use this with packed sequences** (several documents in one row, ``position_ids``
   that go back to 0 in the middle of a row). With the replacement transformers no longer notices
   the packing and runs plain causal attention over the whole row: tokens attend across document
   boundaries and the loss is silently wrong. While a hooked model runs, the replacement is seen
   by every caller in the process (it is a module attribute of transformers).

transformers is imported only when a function here is called, never at import time, and
everything is a no-op returning False when transformers (or the checked function, in versions
that do not have it) is absent.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch.nn as nn
from forge_core.contracts import refuse_documents
from torch.utils.hooks import RemovableHandle

__all__ = [
    "is_hf_model",
    "is_hf_pretrained",
    "is_packed_sequence_patched",
    "no_packed_sequence_sync",
    "restore_packed_sequence_check",
    "skip_packed_sequence_check",
]

_MODULE = "transformers.modeling_flash_attention_utils"
_ATTR = "_is_packed_sequence"


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


@contextmanager
def no_packed_sequence_sync() -> Iterator[bool]:
    """Inside the block, transformers' packed-sequence check is the always-False stand-in.

    Yields whether the stand-in is in effect (False when transformers, or this version's
    ``_is_packed_sequence``, is absent: nothing to replace). On exit the original is put back
    only if this block replaced it and nothing else replaced it meanwhile, so nested blocks (and
    hooked models called inside a block) keep working. **Do NOT use with packed sequences.**
    """
    module = _flash_utils()
    if module is None or not callable(getattr(module, _ATTR, None)):
        yield False
        return
    original = _replace(module)
    try:
        yield True
    finally:
        _restore(module, original)


def _replace(module: ModuleType) -> Any:
    """Put the stand-in in place; returns the function it replaced, or None when it was already
    in place (an enclosing block or hooked forward did it: that one restores)."""
    current = getattr(module, _ATTR)
    if current is _never_packed:
        return None
    setattr(module, _ATTR, _never_packed)
    return current


def _restore(module: ModuleType, original: Any) -> None:
    """Undo :func:`_replace` (nothing if it replaced nothing, or if something else has replaced
    the stand-in since)."""
    if original is not None and getattr(module, _ATTR, None) is _never_packed:
        setattr(module, _ATTR, original)


#: The attribute on a model that :func:`skip_packed_sequence_check` hooked: its hook handles.
HOOKS_ATTR = "_forge_skip_packed_sequence_check"


def skip_packed_sequence_check(model: nn.Module) -> bool:
    """Hook ``model`` so transformers' packed-sequence check is the stand-in while it runs.

    The hooks wrap the forward of ``model`` and of every attention module of the Hugging Face
    models inside it (their class names end in ``Attention``), each in a
    :func:`no_packed_sequence_sync` block: the recompute of a checkpointed block, which runs in
    backward outside the model's forward, is covered too. Returns True when the hooks are in
    place (now or from an earlier call), False when ``model`` holds no Hugging Face model or
    transformers has no such check. Undo with :func:`restore_packed_sequence_check`.
    **Only for sequences that are not packed.**
    """
    if getattr(model, HOOKS_ATTR, None):
        return True
    utils = _flash_utils() if is_hf_model(model) else None
    if utils is None or not callable(getattr(utils, _ATTR, None)):
        return False
    handles: list[RemovableHandle] = []
    for module in (model, *_attention_modules(model)):
        # NOTE: the hooks run per attention layer per forward: the module is looked up once
        # here, and a call nested in the model's forward finds the stand-in and does nothing.
        originals: list[Any] = []

        def enter(*_: Any, originals: list[Any] = originals) -> None:
            originals.append(_replace(utils))

        def leave(*_: Any, originals: list[Any] = originals) -> None:
            if originals:
                _restore(utils, originals.pop())

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    setattr(model, HOOKS_ATTR, handles)
    reason = (
        "transformers' packed-sequence check is skipped on it (packed_sequences=False, "
        "forge.hf_patches.skip_packed_sequence_check; undo with restore_packed_sequence_check)"
    )
    for module in _hooked_models(model):  # NOTE: the hooks act on the models inside it too
        refuse_documents(module, reason)
    return True


def restore_packed_sequence_check(model: nn.Module) -> bool:
    """Remove the hooks :func:`skip_packed_sequence_check` put on ``model``; returns whether
    there were any."""
    handles = getattr(model, HOOKS_ATTR, None)
    if not handles:
        return False
    for handle in handles:
        handle.remove()
    delattr(model, HOOKS_ATTR)
    for module in _hooked_models(model):
        refuse_documents(module, None)
    return True


def _hooked_models(model: nn.Module) -> list[nn.Module]:
    """``model`` and the Hugging Face models inside it, whose attention the hooks reach."""
    return [model, *(m for m in model.modules() if m is not model and is_hf_model(m))]


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of the Hugging Face models in ``model`` (by class-name suffix)."""
    return [m for m in model.modules() if m is not model and type(m).__name__.endswith("Attention")]


def is_hf_pretrained(model: nn.Module) -> bool:
    """Whether ``model`` itself is a ``transformers.PreTrainedModel`` (see :func:`is_hf_model`)."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    return base is not None and isinstance(model, base)


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
