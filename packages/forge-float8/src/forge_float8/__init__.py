"""forge_float8: Float8 training through torchao, in forge's order (after TP/EP, before AC/FSDP2).

- :func:`apply_float8` swaps eligible ``nn.Linear`` modules for torchao's ``Float8Linear``
  (recipes ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``), carries tensor-parallel styles
  over (fp8 all-gathers for tensorwise), and registers the per-step scale precompute for FSDP2's
  fp8 all-gather.
- :func:`float8_report` / :class:`Float8Report`: what was converted, what was skipped and why.
- :func:`check_torchao`: the pure pre-launch check that torchao imports.

Depends on forge_core, torch and torchao.
"""

from .convert import RECIPES, Float8Report, apply_float8, check_torchao, float8_report

__version__ = "0.1.0"

__all__ = ["RECIPES", "Float8Report", "apply_float8", "check_torchao", "float8_report"]
