"""TensorBoard event files for ``forge train`` (``[metrics] tensorboard = true``).

Provides :func:`tensorboard_problems`, the launcher's check that the optional ``tensorboard``
package is there (before any rank starts, without importing torch), and
:class:`TensorBoardLog`, rank 0's writer of the same numbers ``metrics.jsonl`` holds into
``<training.out_dir>/tensorboard``.

Notable choices:

- ``metrics.jsonl`` stays the record; TensorBoard is a view of it, so the tags are the step
  line's fields: ``train/loss``, ``train/grad_norm``, ``train/lr``, ``train/throughput_<unit>``
  (``tok/s`` becomes ``tok_per_s``), ``train/mfu`` (when known), ``memory/peak_bytes_max`` (the
  largest rank's peak: the one that runs out first) and ``validation/loss``.
- A resumed run writes a new event file into the same folder with ``purge_step`` at its first
  step, so TensorBoard hides the earlier run's points from there on: as in ``forge plot``, the
  steps a resume repeats (and those it has not reached again yet) show the resumed run only.
- ``torch.utils.tensorboard`` is imported when a log is opened, never with this module: the
  launcher imports this module before torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from types import TracebackType
from typing import Any

from forge_core.errors import ForgeConfigError

__all__ = ["TENSORBOARD_MISSING", "TensorBoardLog", "tensorboard_problems", "throughput_tag"]

#: The one line a missing (or too old) ``tensorboard`` package gets.
TENSORBOARD_MISSING = (
    "metrics.tensorboard = true needs the tensorboard package: "
    "pip install 'forge-parallel[metrics]' (or set metrics.tensorboard = false)"
)

#: torch.utils.tensorboard refuses older tensorboard packages at import.
_MIN_VERSION = (1, 15)


def _version_tuple(text: str) -> tuple[int, ...]:
    """``"2.21.0rc1"`` -> ``(2, 21)``: the leading numeric parts, enough to compare with 1.15."""
    parts = []
    for piece in text.split(".")[:2]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def tensorboard_problems() -> list[str]:
    """``[]`` when ``torch.utils.tensorboard`` can be used, else :data:`TENSORBOARD_MISSING`.

    Cheap (milliseconds, no torch import): the launcher calls it before ranks start, so a run
    with ``metrics.tensorboard = true`` fails at once rather than on rank 0 after the model is
    built. It checks what torch.utils.tensorboard needs at import: the ``tensorboard`` package
    (1.15 or newer; its top-level import is lazy and cheap) and NumPy.
    """
    try:
        tensorboard = importlib.import_module("tensorboard")
        numpy_spec = importlib.util.find_spec("numpy")
    except ImportError:
        return [TENSORBOARD_MISSING]
    version = _version_tuple(str(getattr(tensorboard, "__version__", "0")))
    if numpy_spec is None or version < _MIN_VERSION:
        return [TENSORBOARD_MISSING]
    return []


def throughput_tag(unit: str) -> str:
    """The tag of the throughput scalar for ``unit``: ``"tok/s"`` -> ``"train/throughput_tok_per_s"``.

    The unit is part of the tag (not only of a label) so two runs of different model kinds,
    tokens and images per second, never share one chart.
    """
    name = re.sub(r"[^A-Za-z0-9]+", "_", unit.replace("/", "_per_")).strip("_")
    return f"train/throughput_{name or 'items_per_s'}"


class TensorBoardLog:
    """Rank 0's TensorBoard writer: event files under ``<out_dir>/tensorboard``.

    ``start_step`` is the step a resumed run continues from (``metrics.jsonl``'s
    ``start_step``): the earlier run's points after it are hidden. Use as a context manager, or
    call :meth:`close`; :meth:`flush` makes what was logged visible to a running TensorBoard
    (the writer also flushes on its own every ``flush_secs``).
    """

    def __init__(self, out_dir: str | Path, *, start_step: int = 0, flush_secs: int = 30) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            reason = " ".join(str(err).split())  # one line, whatever the import said
            raise ForgeConfigError(f"{TENSORBOARD_MISSING} ({reason})") from None
        self.log_dir = Path(out_dir) / "tensorboard"
        # NOTE: purge_step hides events at steps >= it written by earlier event files of this
        # folder; steps are logged 1-based, so a run resumed from step S logs S + 1 first.
        purge = start_step + 1 if start_step > 0 else None
        self._writer: Any = SummaryWriter(
            log_dir=str(self.log_dir), purge_step=purge, flush_secs=flush_secs
        )

    def log_step(
        self,
        step: int,
        *,
        loss: float,
        grad_norm: float,
        lr: float,
        throughput: float,
        unit: str,
        peak_mem_bytes: list[int],
        mfu: float | None,
    ) -> None:
        """Log one optimizer step (1-based ``step``, as in ``metrics.jsonl``)."""
        scalars: dict[str, float] = {
            "train/loss": loss,
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            throughput_tag(unit): throughput,
        }
        if peak_mem_bytes:
            scalars["memory/peak_bytes_max"] = float(max(peak_mem_bytes))
        if mfu is not None:
            scalars["train/mfu"] = mfu
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), global_step=step)

    def log_validation(self, step: int, loss: float) -> None:
        """Log the validation loss measured after optimizer step ``step``."""
        self._writer.add_scalar("validation/loss", float(loss), global_step=step)

    def flush(self) -> None:
        """Write what is queued to the event file now."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; further logging is an error."""
        self._writer.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
