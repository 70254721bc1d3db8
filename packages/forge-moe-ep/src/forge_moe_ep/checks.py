"""Pure checks of an expert-parallel layout (no torch import: a launcher runs them on the config
before any rank starts; :func:`forge_moe_ep.apply_expert_parallel` runs them on the model).
:func:`expert_parallel_problems` and :func:`dispatch_cp_problems` return the problems as one-line
messages (empty: fine); :func:`check_expert_parallel` raises the first;
:func:`moe_layout_problems` runs each that a model config and a layout call for."""

from __future__ import annotations

from forge_core.errors import refuse
from forge_core.model_config import ModelConfig

from .config import MoEModelConfig

__all__ = [
    "check_expert_parallel",
    "dispatch_cp_problems",
    "expert_parallel_problems",
    "moe_layout_problems",
    "no_moe_problems",
]


def no_moe_problems(ep: int, has_moe: bool) -> list[str]:
    """``[message]`` for expert parallelism asked of a model without forge's MoE layers (the one
    wording of the config check, forge's ParallelPlan and :func:`apply_expert_parallel`)."""
    if has_moe:
        return []
    return [
        f"expert parallelism (parallelism.ep={ep}) on a model with no forge_moe_ep.MoE layer: set "
        "parallelism.ep=1 and do not apply it, or use an MoE model ([moe] num_experts > 0, e.g. "
        "model.preset=debug_moe; a Hugging Face model with MoE blocks forge converts, "
        "forge_moe_ep.hf.HF_MOE_BLOCKS; your own model built with forge_moe_ep.moe_transformer)"
    ]


def expert_parallel_problems(num_experts: int, ep: int) -> list[str]:
    """``[message]`` unless ``ep`` ranks can split ``num_experts`` experts."""
    if not num_experts % ep:
        return []
    choices = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
    return [
        f"parallelism.ep={ep} does not divide moe.num_experts={num_experts}: each EP rank "
        f"holds num_experts/ep experts. Choose ep in {choices}; with more data-parallel ranks "
        "than experts the others shard the experts with FSDP2 (the expert_dp axis)"
    ]


def check_expert_parallel(num_experts: int, ep: int) -> None:
    """Pure check that ``ep`` ranks can split ``num_experts`` experts (run before any launch)."""
    refuse(expert_parallel_problems(num_experts, ep))


def dispatch_cp_problems(moe_dispatch: str, cp: int) -> list[str]:
    """``[message]`` for the capacity dispatch under context parallelism (``cp > 1``).

    NOTE: refused, not approximated: the capacity is counted per sequence (``ceil(capacity_factor
    x S x K / E)``, earlier positions win), and a context-parallel rank holds ``S / cp`` tokens of
    each sequence in a load-balanced order (an early and a late chunk), so it would keep and drop
    other tokens than the single-device model (parity: loss 1.2e-4 off after 3 steps).
    Making it exact needs every cp rank's routing of the whole sequence in each MoE layer.
    """
    if cp <= 1 or moe_dispatch != "capacity":
        return []
    return [
        f"moe.moe_dispatch='capacity' with parallelism.cp={cp}: the capacity is counted per "
        "sequence and a context-parallel rank holds only slices of each sequence, so it would "
        "drop other tokens than one device does; set moe.moe_dispatch='dropless' (or "
        "parallelism.cp=1)"
    ]


def expert_tp_problems(tp: int, ep: int, cp: int = 1, *, hidden: int, bias: bool) -> list[str]:
    """Why experts of hidden size ``hidden`` (with output biases: ``bias``) cannot be split over
    ``tp`` ranks with ``parallelism.expert_tp`` (one line each; none: they can)."""
    if tp <= 1:
        return []
    problems = []
    if ep > 1 and cp > 1:
        problems.append(
            f"parallelism.expert_tp with ep={ep} and cp={cp}: ep is then carved out of "
            "dp_shard x cp, which leaves no (ep, tp) mesh to split the experts over; set "
            "parallelism.expert_tp=false, ep=1 or cp=1"
        )
    if bias:
        problems.append(
            "parallelism.expert_tp with experts that have biases (GPT-OSS): every tp rank would "
            "add the output bias; set parallelism.expert_tp=false"
        )
    if hidden % tp:
        problems.append(
            f"parallelism.expert_tp: the experts' hidden size {hidden} is not divisible by "
            f"tp={tp}; choose a tp that divides it or set expert_tp=false"
        )
    return problems


def moe_layout_problems(
    config: ModelConfig, *, ep: int, cp: int, tp: int = 1, expert_tp: bool = False
) -> list[str]:
    """Every MoE rule a layout must keep, for a model config (MoE blocks only in a
    :class:`~forge_moe_ep.config.MoEModelConfig` that names them): expert parallelism needs MoE
    blocks (:func:`no_moe_problems`) whose experts it divides (:func:`expert_parallel_problems`),
    the capacity dispatch takes no context parallelism (:func:`dispatch_cp_problems`), and
    experts split over tp fit it (:func:`expert_tp_problems`)."""
    moe = config if isinstance(config, MoEModelConfig) and config.moe_layers else None
    problems = []
    if ep > 1:
        problems += no_moe_problems(ep, moe is not None)
        problems += expert_parallel_problems(moe.num_experts, ep) if moe is not None else []
    if moe is not None:
        problems += dispatch_cp_problems(moe.moe_dispatch, cp)
        if expert_tp:
            assert moe.moe_ffn_dim is not None  # NOTE: MoEModelConfig fills it
            hidden, bias = moe.moe_ffn_dim, moe.expert_linear_bias
            problems += expert_tp_problems(tp, ep, cp, hidden=hidden, bias=bias)
    return problems
