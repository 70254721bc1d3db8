"""Rank functions of the context-parallel layer tests (module level, so the rank pool can pickle
them); those that build through forge's ParallelPlan are in tests/integration/cp/jobs.py."""

from __future__ import annotations

from typing import Any

import torch
from forge_core import ModelConfig, Transformer
from forge_mesh import build_device_mesh


def attention_errors(cp: int, n_heads: int, n_kv_heads: int) -> list[float]:
    """Max differences, in float64, between the context-parallel kernel and SDPA over the whole
    sequence: the output and the gradients of q, k and v (this rank's part of each)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from forge_cp import ContextParallelAttention, shard_sequence

    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    shape = (2, n_heads, 8 * cp, 16)
    kv_shape = (2, n_kv_heads, 8 * cp, 16)
    q, k, v = (
        torch.randn(s, generator=g, dtype=torch.float64).requires_grad_()
        for s in (shape, kv_shape, kv_shape)
    )
    gqa = n_heads != n_kv_heads
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    grad = torch.randn(reference.shape, generator=g, dtype=torch.float64)
    reference.backward(grad)
    rank = dist.get_rank()
    mine = [shard_sequence(t.detach(), cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(dist.group.WORLD, rank, cp)(*mine, enable_gqa=gqa)
    out.backward(shard_sequence(grad, cp, rank, dim=2))
    pairs = [(out, reference)] + [(a.grad, b.grad) for a, b in zip(mine, (q, k, v), strict=True)]
    return [float((a - shard_sequence(b, cp, rank, dim=2)).abs().max().detach()) for a, b in pairs]


def order_and_refusals() -> dict[str, str]:
    """What apply_context_parallel says out of order, twice, and on models it cannot run."""
    from forge_core import ForgeConfigError
    from forge_core.stages import check_stage
    from forge_cp import apply_context_parallel
    from forge_fsdp_wrap import apply_ac

    mesh = build_device_mesh({"cp": 2}, "cpu")
    said: dict[str, str] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            said[name] = "ran"
        except ForgeConfigError as e:
            said[name] = str(e)

    cfg = ModelConfig.preset("debug")
    with torch.device("meta"):
        late, twice, first = Transformer(cfg), Transformer(cfg), Transformer(cfg)
        plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    apply_ac(late, "full")
    attempt("after_ac", lambda: apply_context_parallel(late, mesh))
    apply_context_parallel(twice, mesh)
    attempt("twice", lambda: apply_context_parallel(twice, mesh))
    apply_context_parallel(first, mesh)
    attempt("tp_after", lambda: check_stage(first, "tp"))
    attempt("no_attention", lambda: apply_context_parallel(plain, mesh))
    import transformers

    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    small |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    attempt("hugging_face", lambda: apply_context_parallel(hf, mesh))
    return said
