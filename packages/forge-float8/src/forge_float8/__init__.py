"""forge_float8: Float8 training through torchao, in forge's order (after TP/EP, before AC/FSDP2).

- :func:`apply_float8` swaps eligible ``nn.Linear`` modules for torchao's ``Float8Linear``
  (recipes ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``), carries tensor-parallel styles
  over (fp8 all-gathers for tensorwise), and registers the per-step scale precompute for FSDP2's
  fp8 all-gather.
- :func:`float8_report` / :class:`Float8Report`: what was converted, what was skipped and why.
- :class:`Float8Config` (``[float8]``) and ``FLOAT8_RECIPES``: the settings, checked as built
- :func:`use_torch_cpu_fp8_kernels`: CPU fp8 GEMMs on torch's own kernel, not oneDNN's slow
  reference one, and :func:`cpu_scaled_mm_supports`: whether this torch's CPU fp8 GEMM takes a
  recipe's scales (torch 2.11's takes per-tensor scales only; rowwise is then emulated on CPU)
  (:mod:`forge_float8.cpu`).
- :func:`check_float8` / :func:`check_torchao`: the pre-launch checks (settings that cannot
  work together; torchao importable here), in :mod:`forge_float8.checks` (no torch import).

Depends on forge_core, torch and torchao.
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

# NOTE: imported on first use, so that the checks (forge_float8.checks) load without torch.
_EXPORTS = {
    "RECIPES": "convert",
    "Float8Report": "convert",
    "apply_float8": "convert",
    "float8_report": "convert",
    "check_float8": "checks",
    "check_torchao": "checks",
    "FLOAT8_RECIPES": "config",
    "Float8Config": "config",
    "use_torch_cpu_fp8_kernels": "cpu",
    "cpu_scaled_mm_supports": "cpu",
}

if TYPE_CHECKING:
    from .checks import check_float8, check_torchao
    from .config import FLOAT8_RECIPES, Float8Config
    from .convert import RECIPES, Float8Report, apply_float8, float8_report
    from .cpu import cpu_scaled_mm_supports, use_torch_cpu_fp8_kernels

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "FLOAT8_RECIPES",
    "RECIPES",
    "Float8Config",
    "Float8Report",
    "apply_float8",
    "check_float8",
    "check_torchao",
    "cpu_scaled_mm_supports",
    "float8_report",
    "use_torch_cpu_fp8_kernels",
]
