"""Pure checks of an expert-parallel layout (no torch import: a launcher runs them on the config
before any rank starts; :func:`forge_moe_ep.apply_expert_parallel` runs them on the model).
:func:`expert_parallel_problems` returns the problems as one-line messages (empty: fine);
:func:`check_expert_parallel` raises the first."""

from __future__ import annotations

from forge_core.errors import refuse

__all__ = ["check_expert_parallel", "expert_parallel_problems"]


def expert_parallel_problems(num_experts: int, ep: int) -> list[str]:
    """``[message]`` unless ``ep`` ranks can split ``num_experts`` experts."""
    if not num_experts % ep:
        return []
    choices = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
    return [
        f"parallelism.ep={ep} does not divide model.num_experts={num_experts}: each EP rank "
        f"holds num_experts/ep experts. Choose ep in {choices}; with more data-parallel ranks "
        "than experts the others shard the experts with FSDP2 (the expert_dp axis)"
    ]


def check_expert_parallel(num_experts: int, ep: int) -> None:
    """Pure check that ``ep`` ranks can split ``num_experts`` experts (run before any launch)."""
    refuse(expert_parallel_problems(num_experts, ep))
