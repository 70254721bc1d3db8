"""forge_core.testing: the tools forge's tests (and forge build's parity check) use.

- :class:`RankPool`: N gloo ranks on the CPU kept alive between calls (:mod:`.harness`)
- :func:`run_parity`, :func:`train_steps`, :func:`compare_runs`, :class:`ParityResult`: the
  parity check against a single-device model (:mod:`.parity`)
- :func:`no_host_sync`, :func:`count_host_syncs`, :class:`HostSyncError`: catch device-to-host
  synchronizations (:mod:`.sync_guard`)
- :data:`TINY_HF_DECODER`: the sizes of the tiny Hugging Face decoders tests build (:mod:`.hf`)
- :class:`SavedTensorPeak`: the peak bytes autograd holds for backward (:mod:`.saved`)

Nothing in forge's layers imports this package; it is here so that every layer's tests, and
projects vendoring a layer, prove parity the same way.
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_EXPORTS = {
    "RankError": "harness",
    "RankPool": "harness",
    "ParityResult": "parity",
    "StepRecord": "parity",
    "Tolerances": "parity",
    "compare_runs": "parity",
    "run_parity": "parity",
    "tolerances_for": "parity",
    "train_steps": "parity",
    "HostSyncError": "sync_guard",
    "count_host_syncs": "sync_guard",
    "no_host_sync": "sync_guard",
    "TINY_HF_DECODER": "hf",
    "SavedTensorPeak": "saved",
}

if TYPE_CHECKING:
    from .harness import RankError, RankPool
    from .hf import TINY_HF_DECODER
    from .parity import (
        ParityResult,
        StepRecord,
        Tolerances,
        compare_runs,
        run_parity,
        tolerances_for,
        train_steps,
    )
    from .saved import SavedTensorPeak
    from .sync_guard import HostSyncError, count_host_syncs, no_host_sync

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "TINY_HF_DECODER",
    "HostSyncError",
    "ParityResult",
    "RankError",
    "RankPool",
    "SavedTensorPeak",
    "StepRecord",
    "Tolerances",
    "compare_runs",
    "count_host_syncs",
    "no_host_sync",
    "run_parity",
    "tolerances_for",
    "train_steps",
]
