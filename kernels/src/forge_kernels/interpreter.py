"""Let triton's CPU interpreter run forge's kernels on the old triton + new numpy pair.

For running the kernels with ``TRITON_INTERPRET=1`` on a CPU (forge-kernels' tests, the
benchmarks' CPU runs); nothing in forge-kernels imports it.

triton 3.6 (the lent GPU machines' version) turns a runtime loop bound of an interpreted kernel
into a Python int with ``int(array)``, where the interpreter holds every scalar as a 1-element
array; numpy >= 2.4 refuses ``int()`` of a 1-element array (``TypeError: only 0-dimensional
arrays can be converted to Python scalars``, triton issue #9171; newer triton squeezes first).
Every interpreted forge kernel has such a bound, so on that pair all of them fail on CPU while
the compiled kernels on a GPU are unaffected. :func:`interpreter_index_fix` installs triton's
own later behaviour (squeeze, then convert) for the duration of a test session; it does nothing
where numpy still converts 1-element arrays.

NOTE: this touches a private function of triton's interpreter (``_patch_lang_tensor``); if
triton renames it the fixture fails loudly with an AttributeError, not silently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def numpy_refuses_1_element_int() -> bool:
    """Whether ``int(np.array([1]))`` raises (numpy >= 2.4)."""
    import numpy as np

    try:
        int(np.array([1]))
    except TypeError:
        return True
    return False


@contextlib.contextmanager
def interpreter_index_fix() -> Iterator[None]:
    """While active, interpreted kernels convert 1-element loop bounds as newer triton does."""
    if not numpy_refuses_1_element_int():
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = original
