"""Pure checks of an expert-parallel layout (no torch import: a launcher runs them on the config
before any rank starts; :func:`forge_moe_ep.apply_expert_parallel` runs them on the model)."""

from __future__ import annotations

from forge_core.errors import ForgeConfigError

__all__ = ["check_expert_parallel"]


def check_expert_parallel(num_experts: int, ep: int) -> None:
    """Pure check that ``ep`` ranks can split ``num_experts`` experts (run before any launch)."""
    if num_experts % ep:
        choices = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ForgeConfigError(
            f"parallelism.ep={ep} does not divide model.num_experts={num_experts}: each EP rank "
            f"holds num_experts/ep experts. Choose ep in {choices}; with more data-parallel ranks "
            "than experts the others shard the experts with FSDP2 (the expert_dp axis)"
        )
