"""The MoE layer for the reference Transformer's FFN slot.

Provides :class:`MoE` (router + grouped SwiGLU experts + optional shared expert),
:func:`moe_transformer` and :func:`moe_metrics`; its parts :class:`Router`
(:mod:`forge_moe_ep.router`) and :class:`GroupedExperts` (:mod:`forge_moe_ep.experts`).

Module names (stable; plans and wrappers refer to them)::

    feed_forward                 MoE
    feed_forward.router.gate     nn.Linear(dim -> num_experts), no bias
    feed_forward.experts         GroupedExperts: w1, w3 [E, dim, hidden], w2 [E, hidden, dim]
    feed_forward.shared_expert   forge_core FeedForward (w1, w2, w3) or absent

Notable choices:

- The router runs in float32 (autocast off, weights upcast): top-k on bf16 scores flips
  choices between runs that differ only in rounding.
- Aux-loss-free balancing: ``router.expert_bias`` (a buffer, never trained) is added to the
  scores only to choose experts; the combine weights are the unbiased scores. Token counts
  accumulate over every training forward (all micro-batches) and, after each optimizer step
  (:meth:`MoE.forge_after_optimizer_step`, installed by
  ``forge_core.contracts.attach_optimizer_hooks``), are summed over the data-parallel ranks and
  turned into a mean-centred update ``rate * sign(mean - count)``: identical on every rank.
- Counting and the auxiliary loss skip forwards that run inside a backward pass (activation
  checkpointing recomputes the forward there), so AC does not double-count.
- Experts are stacked ``[E, ...]`` and run through ``forge_kernels.grouped_gemm``; an expert
  without tokens gets a zero gradient (not None), so optimizer state never diverges.
- The layer is purely local and holds no process group: it routes, lays its tokens out per
  expert (:mod:`forge_moe_ep.dispatch`), calls ``self.experts(rows, offs)`` and combines the
  result with the router weights. Expert parallelism is applied from outside
  (``forge_moe_ep.parallel.apply_expert_parallel``): it shards the experts' weights and installs
  the cross-rank token dispatch and return as forward hooks on ``experts`` (and, to start the
  split-size exchange early, on ``router``), and the data-parallel sum of the token counts as a
  load hook (:meth:`MoE.register_load_hook`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn as nn
from forge_core.init import fill_param_
from forge_core.model import FeedForward, ModelConfig, Transformer
from forge_core.torch_compat import in_backward_pass
from forge_kernels.permute import RoutingLayout, combine, permute, routing_layout
from torch.utils.hooks import RemovableHandle

from .checks import dispatch_cp_problems
from .config import MoEModelConfig
from .dispatch import capacity_layout, capacity_per_sequence
from .experts import GroupedExperts, grouped_experts
from .router import Router

__all__ = ["GroupedExperts", "MoE", "Router", "moe_metrics", "moe_transformer"]


class MoE(nn.Module):
    """Mixture-of-experts FFN: ``[B, S, dim] -> [B, S, dim]`` (see the module docstring)."""

    tokens_routed: torch.Tensor  # buffers (typed for checkers: register_buffer sets them)
    tokens_dropped: torch.Tensor

    #: Runs eagerly under forge's per-block compile (forge_core.contracts): dropless EP reads
    #: split sizes on the host and the Triton kernels are opaque autograd Functions.
    forge_no_compile = True
    #: Left whole by tensor parallelism (forge_core.contracts): the experts shard over ep, the
    #: router and shared expert are small; a Hugging Face plan's expert entries must not apply.
    forge_tp_skip = "forge's MoE runs whole on each tp rank; its experts shard over ep"
    #: Kept out of Float8 (forge_core.contracts): the experts run grouped GEMMs that never call
    #: Float8Linear.forward, the shared expert runs beside them, the router needs fp32.
    forge_float8_skip = (
        "MoE experts run grouped GEMMs (not Float8Linear); router and shared expert stay with them"
    )

    def forge_cp_problems(self, cp: int) -> list[str]:
        """Why this layer cannot run on ``cp`` sequence shards (forge_core.contracts): the
        capacity dispatch (:func:`forge_moe_ep.checks.dispatch_cp_problems`)."""
        return dispatch_cp_problems(self.config.moe_dispatch, cp)

    def __init__(
        self, config: MoEModelConfig, layer_id: int = 0, experts_dim: int | None = None
    ) -> None:
        super().__init__()
        c = config
        self.config, self.layer_id = c, layer_id
        self.num_experts, self.top_k = c.num_experts, c.top_k
        self.router = Router(
            c.dim,
            c.num_experts,
            c.top_k,
            c.router,
            renormalize=c.router_renormalize,
            scale=c.router_scale,
            groups=c.router_groups,
            topk_groups=c.router_topk_groups,
            group_top=c.router_group_top,
            bias=c.router_bias,
            choice=c.router_choice,
            group_mask=c.router_group_mask,
            renormalize_min=c.router_renormalize_min,
            logit_scale=c.router_logit_scale,
        )
        #: the experts work at ``experts_dim`` (None: the model's; a latent width between
        #: ``expert_in`` and ``expert_out``)
        self.experts = grouped_experts(c, experts_dim or c.dim)
        #: Any module ``[T, dim] -> [T, dim]`` (a converted Hugging Face block keeps its own).
        self.shared_expert: nn.Module | None = (
            FeedForward(c.dim, c.num_shared_experts * c.moe_ffn_dim)  # type: ignore[operator]
            if c.num_shared_experts
            else None
        )
        self.shared_expert_gate = nn.Linear(c.dim, 1, bias=False) if c.shared_expert_gate else None
        #: Modules ``[T, dim] -> [T, d]`` and back around the routed experts, which then work
        #: at width ``d`` (a converted Hugging Face block's latent projections; None: none),
        #: and a row-wise module applied to each expert output row before it is weighted (a
        #: block's norm of its experts' outputs).
        self.expert_in: nn.Module | None = None
        self.expert_out: nn.Module | None = None
        self.expert_norm: nn.Module | None = None
        # Training-forward counters of routed and dropped (token, expert) slots (see moe_metrics).
        self.register_buffer("tokens_routed", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("tokens_dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        #: Host waits for split sizes made by the token dispatch installed on this layer from
        #: outside (dropless expert parallelism: one per forward; see moe_metrics).
        self.host_syncs = 0
        self._expert_load_hooks: OrderedDict[int, Callable[[torch.Tensor], None]] = OrderedDict()
        self._aux_loss: torch.Tensor | None = None

    @classmethod
    def for_block(cls, config: ModelConfig, layer_id: int) -> MoE:
        """``Transformer``'s ``ffn_factory``: the MoE of block ``layer_id`` (a block of
        ``config.custom_ffn_layers``, which only an ``MoEModelConfig`` names)."""
        assert isinstance(config, MoEModelConfig)
        return cls(config, layer_id)

    # ------------------------------------------------------------------ forward
    def forward(self, x_BSD: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Route, lay the tokens out per expert, run ``self.experts``, combine, add the shared
        expert. Module calls in order: ``router``, then ``shared_expert``, then ``experts`` (hooks
        installed from outside rely on it: see ``forge_moe_ep.parallel``). ``ids``: each token's
        experts ``[B, S, K]`` chosen already (hash routing), which the router then weights."""
        batch, seq_len, dim = x_BSD.shape
        x_TD = x_BSD.reshape(-1, dim)
        if ids is None:
            weights, ids, scores = self.router(x_TD)
        else:
            weights, ids, scores = self.router(x_TD, ids.reshape(-1, self.top_k))
        # NOTE: a forward without autograd (an evaluation, torch's pipeline shape inference on
        # zeros) never reaches an optimizer step: it does not count toward load balancing.
        record = self.training and torch.is_grad_enabled() and not in_backward_pass()
        if record:
            counts = self.router.tokens_per_expert  # dtype follows module.to(dtype)
            counts.index_add_(0, ids.view(-1), torch.ones_like(ids, dtype=counts.dtype).view(-1))
            self.tokens_routed += ids.numel()
            if self.config.moe_aux_loss_coef > 0:
                self._aux_loss = self._load_balancing_loss(ids, scores)

        if self.config.moe_dispatch == "capacity":
            routed = self._capacity(x_TD, ids, weights, batch, seq_len, record)
        else:
            # Exactly the routed rows, variable groups: permute / combine are permutations.
            layout = routing_layout(ids, self.num_experts)
            x_rows = permute(self._expert_input(x_TD), layout, self.top_k, dense=True)
            if self.config.router_weights_on_input:
                x_rows, weights = self._weighted_rows(x_rows, layout, weights, dense=True)
            # NOTE: the shared expert runs between the permute and the experts call: under
            # expert parallelism a split-size copy to the host is in flight there (started
            # after the router), and this device work hides it before the host waits.
            shared_out = self._shared(x_TD)
            y_rows = self._expert_rows(x_rows, layout.offs)
            routed = self._expert_output(combine(y_rows, layout, weights, dense=True))
            if shared_out is not None:
                routed = routed + shared_out
        return routed.view(batch, seq_len, dim)

    def _expert_rows(self, x_rows: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        y_rows = self.experts(x_rows, offs)
        return y_rows if self.expert_norm is None else self.expert_norm(y_rows)

    def _expert_input(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD if self.expert_in is None else self.expert_in(x_TD)

    def _expert_output(self, routed: torch.Tensor) -> torch.Tensor:
        return routed if self.expert_out is None else self.expert_out(routed)

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is None:
            return None
        out = self.shared_expert(x_TD)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x_TD)) * out
        return out

    @staticmethod
    def _weighted_rows(
        x_rows: torch.Tensor, layout: RoutingLayout, weights: torch.Tensor, *, dense: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``router_weights_on_input``: each row scaled by its slot's weight (the weights move
        with the rows: a permute of ``[T*K, 1]`` slots), and unit weights for the combine."""
        slot_weights = weights.reshape(-1, 1).to(x_rows.dtype)
        x_rows = x_rows * permute(slot_weights, layout, 1, dense=dense)
        return x_rows, torch.ones_like(weights)

    def _capacity(
        self,
        x_TD: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        batch: int,
        seq_len: int,
        record: bool,
    ) -> torch.Tensor:
        """Capped dispatch (no host sync): ``E`` equal groups of ``batch x capacity`` rows."""
        shared_out = self._shared(x_TD)
        if batch == 0:
            # No sequences (on every rank alike, as equal splits require): the experts run on
            # zero rows so their gradients are zeros, not None.
            empty = self._expert_output(self._expert_rows(self._expert_input(x_TD[:0]), None))
            routed = empty.sum(0, keepdim=True).expand(0, -1)
        else:
            capacity = capacity_per_sequence(
                seq_len, self.top_k, self.num_experts, self.config.capacity_factor
            )
            layout, dropped = capacity_layout(ids, self.num_experts, batch, capacity)
            if record:
                self.tokens_dropped += dropped
            x_rows = permute(self._expert_input(x_TD), layout, self.top_k)  # [E*batch*cap, D]
            if self.config.router_weights_on_input:
                x_rows, weights = self._weighted_rows(x_rows, layout, weights)
            # NOTE: offs=None (equal groups) rather than layout.offs: the group sizes are then
            # known from shapes, so an expert-parallel dispatch moves the rows with equal splits
            # and no host sync.
            routed = self._expert_output(combine(self._expert_rows(x_rows, None), layout, weights))
        return routed if shared_out is None else routed + shared_out

    def _load_balancing_loss(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``coef * E * sum_e f_e * p_e``: f = routed fraction (no grad), p = mean score."""
        counts = torch.zeros(self.num_experts, device=ids.device, dtype=torch.float32)
        counts.index_add_(0, ids.view(-1), torch.ones(ids.numel(), device=ids.device))
        fraction = counts / ids.numel()
        probs = scores if self.router.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return self.config.moe_aux_loss_coef * self.num_experts * (fraction * probs.mean(0)).sum()

    # ------------------------------------------------------------------ forge contracts
    def forge_pop_aux_loss(self) -> torch.Tensor | None:
        """The auxiliary loss of the last training forward (then forgotten), or None."""
        loss, self._aux_loss = self._aux_loss, None
        return loss

    def register_load_hook(self, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """Run ``hook(counts)`` on the per-expert token counts before each bias update.

        ``counts`` is ``router.tokens_per_expert`` (float32 ``[E]``, this rank's training
        forwards since the last update); the hook may change it in place. ``apply_expert_parallel``
        installs one that sums the counts over the data-parallel ranks, so every rank applies
        the same update; the layer itself holds no process group. Hooks run in registration
        order, only when the update runs (``moe_bias_update_rate > 0``). Returns a handle whose
        ``remove()`` uninstalls the hook.
        """
        handle = RemovableHandle(self._expert_load_hooks)
        self._expert_load_hooks[handle.id] = hook
        return handle

    @torch.no_grad()
    def forge_after_optimizer_step(self) -> None:
        """Aux-loss-free balancing: move the expert bias toward under-used experts, then reset.

        The load hooks (:meth:`register_load_hook`) first turn this rank's counts into the
        counts of all data-parallel ranks, so every rank applies the same update;
        ``rate * sign(mean - count)``, mean-centred so the biases stay centred.
        """
        rate = self.config.moe_bias_update_rate
        counts = self.router.tokens_per_expert
        if rate > 0:
            for hook in self._expert_load_hooks.values():
                hook(counts)
            delta = rate * torch.sign(counts.mean() - counts)
            self.router.expert_bias += delta - delta.mean()
        counts.zero_()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init, same values sharded or not (names prefixed by the block)."""
        prefix = f"layers.{self.layer_id}.feed_forward."
        std = 0.02
        depth_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.rsplit(".", 1)[-1] in ("b1", "b2", "b3", "bias"):
                param.zero_()
                continue
            s = depth_std if name.endswith("w2") or name.endswith("w2.weight") else std

            def normal(t: torch.Tensor, g: torch.Generator, s: float = s) -> torch.Tensor:
                return nn.init.trunc_normal_(t, 0.0, s, -3 * s, 3 * s, generator=g)

            fill_param_(param, prefix + name, seed, normal)
        self.router.expert_bias.zero_()
        self.router.tokens_per_expert.zero_()
        self.tokens_routed.zero_()
        self.tokens_dropped.zero_()
        self._aux_loss = None


def moe_transformer(config: ModelConfig) -> Transformer:
    """The reference Transformer with :class:`MoE` in the blocks ``config.moe_layers`` names
    (an ``MoEModelConfig``; any other ``ModelConfig`` gives the dense model)."""
    return Transformer(config, ffn_factory=MoE.for_block)


def moe_metrics(model: nn.Module) -> dict[str, int]:
    """Counters summed over the MoE layers of ``model`` (reading them syncs the host once).

    ``tokens_routed`` / ``tokens_dropped``: (token, expert) slots routed, and dropped by the
    capacity mode, in training forwards on this rank since ``init_weights``; ``host_syncs``:
    host waits for split sizes (dropless EP forwards; counted by the dispatch hooks).
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    counters = (
        torch.stack([torch.stack([m.tokens_routed, m.tokens_dropped]).cpu() for m in layers]).sum(0)
        if layers
        else torch.zeros(2, dtype=torch.int64)
    )
    routed, dropped = counters.tolist()
    return {
        "moe_layers": len(layers),
        "tokens_routed": routed,
        "tokens_dropped": dropped,
        "host_syncs": sum(m.host_syncs for m in layers),
    }
