"""What an MoE layer costs in a training step, for ``forge plan``: the activations autograd
keeps for one MoE slot, and expert parallelism's all-to-alls and load reductions.

Routing is balanced unless a skew is given (dropless: every token's ``top_k`` rows, the busiest
expert-parallel rank's experts ``skew`` times as many; capacity: the capped buffer), so the
counts are those of an average step.
"""

from __future__ import annotations

import math

from forge_core.costs import CollectiveTally

from .config import MoEModelConfig

__all__ = [
    "active_params",
    "ep_collectives",
    "expert_load_collectives",
    "expert_skew",
    "ffn_slot_activation_bytes",
    "ffn_slot_op_bytes",
    "moe_slot_activation_bytes",
    "moe_slot_op_bytes",
    "routed_active_params",
    "routed_rows",
]


def routed_rows(m: MoEModelConfig, b: int, s: int) -> int:
    """Rows an MoE layer sends to its experts for ``b`` sequences of ``s`` tokens (a cp rank's
    share): ``T k`` dropless, ``E b capacity`` capped."""
    if m.moe_dispatch == "dropless":
        return b * s * m.top_k
    return m.num_experts * b * max(1, math.ceil(m.capacity_factor * s * m.top_k / m.num_experts))


def moe_slot_activation_bytes(
    m: MoEModelConfig, b: int, s: int, itemsize: int, *, expert_skew: float = 1.0
) -> int:
    """What autograd keeps for one MoE slot (the block's FFN position) for ``b`` sequences of
    ``s`` tokens, replicated on tp: scores ``4 T E``, offsets ``4 E``, per (token, choice) ids,
    float32 weight and scatter index ``20 T k``, per routed row the permuted input, grouped
    SwiGLU, expert output (kept by the combine) and gather index ``R (2 d e + 4 moe_ffn e + 8)``,
    below fp32 the router's float32 input and weight ``4 T d + 4 E d``, and the shared expert
    ``4 T shared_hidden e``. ``expert_skew``: the rows this rank's experts get over the balanced
    ``R`` (the busiest rank under expert parallelism): the permuted input and the grouped SwiGLU
    scale with it; the expert output the combine keeps and the gather index are the rank's own
    tokens'."""
    hidden, d, e = m.moe_ffn_dim, m.dim, itemsize
    assert hidden  # filled in by MoEModelConfig.__post_init__
    tok, n_exp, rows = b * s, m.num_experts, routed_rows(m, b, s)
    kept = 4 * tok * n_exp + 4 * n_exp + tok * m.top_k * 20
    kept += rows * (8 + d * e) + math.ceil(rows * expert_skew) * (d * e + 4 * hidden * e)
    kept += 4 * d * (tok + n_exp) if e != 4 else 0
    return kept + 4 * tok * m.num_shared_experts * hidden * e


def moe_slot_op_bytes(
    m: MoEModelConfig, b: int, s: int, itemsize: int, *, expert_skew: float = 1.0
) -> int:
    """What op-level AC (``ac_mode="op"``: the outputs of matmuls are saved, the rest
    recomputed) keeps of one MoE slot for ``b`` sequences of ``s`` tokens: the router's float32
    scores ``4 T E``, the shared expert's three projections ``T (2 shared_hidden + d) e``, the
    routed rows' grouped projections ``R (2 moe_ffn + d) e`` and the combine's weighted sum in
    float32 ``4 T d``. Expert parallelism's all-to-alls are forge's own autograd functions, so
    op mode runs them again in backward rather than keeping their outputs. ``expert_skew``: as
    in :func:`moe_slot_activation_bytes` (the grouped projections scale with it)."""
    hidden, d, e = m.moe_ffn_dim, m.dim, itemsize
    assert hidden  # filled in by MoEModelConfig.__post_init__
    tok, rows = b * s, math.ceil(routed_rows(m, b, s) * expert_skew)
    kept = 4 * tok * m.num_experts + rows * (2 * hidden + d) * e + 4 * tok * d
    return kept + (tok * (2 * m.num_shared_experts * hidden + d) * e if m.num_shared_experts else 0)


def ffn_slot_activation_bytes(
    m: MoEModelConfig, dense: int, b: int, s: int, itemsize: int, *, expert_skew: float = 1.0
) -> tuple[int, ...]:
    """What autograd keeps for each block's FFN slot: ``dense`` for a dense block, an MoE
    block's own (:func:`moe_slot_activation_bytes`)."""
    moe = dense
    if m.moe_layers:
        moe = moe_slot_activation_bytes(m, b, s, itemsize, expert_skew=expert_skew)
    return tuple(moe if m.is_moe_layer(i) else dense for i in range(m.n_layers))


def ffn_slot_op_bytes(
    m: MoEModelConfig, dense: int, b: int, s: int, itemsize: int, *, expert_skew: float = 1.0
) -> tuple[int, ...]:
    """:func:`ffn_slot_activation_bytes` under op-level AC: ``dense`` (the dense FFN's matmul
    outputs) or :func:`moe_slot_op_bytes`."""
    moe = dense
    if m.moe_layers:
        moe = moe_slot_op_bytes(m, b, s, itemsize, expert_skew=expert_skew)
    return tuple(moe if m.is_moe_layer(i) else dense for i in range(m.n_layers))


def expert_skew(m: MoEModelConfig, ep: int, skew: float) -> float:
    """The routing skew that applies to a rank's experts: ``skew`` (the busiest rank's routed
    rows over the balanced count) under expert parallelism with dropless dispatch; 1 otherwise
    (without EP a rank's experts get all its rows; a capacity buffer is capped)."""
    return skew if ep > 1 and m.moe_dispatch == "dropless" and m.moe_layers else 1.0


def routed_active_params(m: MoEModelConfig) -> int:
    """Routed-expert parameters one token's forward uses: ``top_k`` experts' three
    projections in every MoE block (the part of :func:`active_params` a skew slows)."""
    assert m.moe_ffn_dim is not None  # MoEModelConfig.__post_init__ defaults it to ffn_dim
    return len(m.moe_layers) * m.top_k * 3 * m.dim * m.moe_ffn_dim


def active_params(m: MoEModelConfig) -> int:
    """Parameters one token's forward uses: all, less the routed experts it does not visit
    (``num_experts - top_k`` per MoE block)."""
    assert m.moe_ffn_dim is not None  # MoEModelConfig.__post_init__ defaults it to ffn_dim
    idle = (m.num_experts - m.top_k) * 3 * m.dim * m.moe_ffn_dim
    return m.num_params() - len(m.moe_layers) * idle


def ep_collectives(
    tally: CollectiveTally, m: MoEModelConfig, layer_passes: int, nbytes: int, ac: int
) -> None:
    """The ``ep`` all-to-alls of ``layer_passes`` MoE layer forwards moving ``nbytes`` each way
    (``ac``: 1 when AC full runs each forward again in backward)."""
    again = 1 + ac
    how = "(balanced routing)"
    if m.moe_dispatch == "capacity":
        how = "(capacity buffer)"
    else:
        tally.add(
            "forward all_to_all", "ep", 4 * m.num_experts, layer_passes * again, "EP: expert counts"
        )
    tally.add(
        "forward all_to_all", "ep", nbytes, 2 * layer_passes * again, f"EP: dispatch+combine {how}"
    )
    tally.add("backward all_to_all", "ep", nbytes, 2 * layer_passes, "EP: their gradients")


def expert_load_collectives(
    tally: CollectiveTally, m: MoEModelConfig, moe_layers: int, *, cp: int
) -> None:
    """The step's expert-load sums (the router bias update): one per MoE layer, over every
    rank holding other tokens (data parallel, and cp when it is on)."""
    if moe_layers and m.moe_bias_update_rate > 0:
        loads = "dp_cp" if cp > 1 else "dp"
        tally.add("step all_reduce", loads, 4 * m.num_experts, moe_layers, "MoE expert loads")
