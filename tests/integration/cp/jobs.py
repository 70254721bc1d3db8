"""Rank functions of the context-parallel tests that build through forge's ParallelPlan or compose
forge_cp with another layer (forge_fsdp_wrap's apply_ac) (module level, so the rank pool can pickle
them); forge_cp's own are in packages/forge-cp/tests/jobs.py."""

from __future__ import annotations

from typing import Any

import torch
from forge.build import ParallelPlan
from forge_core import ModelConfig, Transformer
from forge_core.testing import ParityResult, compare_runs, train_steps
from forge_core.training import synthetic_tokens
from forge_mesh import build_device_mesh

from tests.integration.pp.jobs import meta_model


def packed_positions(steps: int, batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Positions ``[steps, batch_size, seq_len]`` of packed documents of uneven lengths: row 0
    of each step is one long document after two short ones (the load a fixed pairing of chunks
    balances worst), the others random cuts (1 to 4 documents)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(steps, batch_size, seq_len, dtype=torch.long)
    for step in range(steps):
        for row in range(batch_size):
            if row == 0:
                cuts = [2, 5]
            else:
                count = int(torch.randint(0, 4, (), generator=g))
                cuts = sorted(set(torch.randint(1, seq_len, (count,), generator=g).tolist()))
            bounds = [0, *cuts, seq_len]
            lengths = torch.tensor(bounds).diff().tolist()
            out[step, row] = torch.cat([torch.arange(n) for n in lengths])
    return out


def cp_parity(
    layout: dict[str, Any],
    *,
    moe: bool = False,
    steps: int = 10,
    batch_size: int = 4,
    seq_len: int = 32,
    model: dict[str, Any] | None = None,
    documents: bool = False,
    **plan: Any,
) -> ParityResult:
    """A context-parallel model (``layout`` has cp) against the same model on one device, fp32;
    with ``documents``, both trained on packed documents (:func:`packed_positions`)."""
    parallel_model, cfg = meta_model(moe, **(model or {}))
    reference_model, _ = meta_model(moe, **(model or {}))
    experts = getattr(cfg, "num_experts", 0) if moe else 0
    mesh = build_device_mesh(layout, "cpu", num_experts=experts)
    parallel = ParallelPlan(mesh, param_dtype=torch.float32, **plan).parallelize(
        parallel_model, device="cpu", seed=0
    )
    reference = ParallelPlan(None, param_dtype=torch.float32).parallelize(
        reference_model, device="cpu", seed=0
    )
    tokens = synthetic_tokens(0, steps, batch_size, seq_len, cfg.vocab_size)
    positions = packed_positions(steps, batch_size, seq_len) if documents else None
    return compare_runs(
        train_steps(reference, tokens, positions=positions),
        train_steps(parallel, tokens, mesh=mesh, positions=positions),
    )


def _cp2_and_one_device(variant: str) -> tuple[Any, ModelConfig, torch.nn.Module, torch.nn.Module]:
    """``(mesh, config, model, reference)``: forge's debug model at cp=2 (``[cp] variant``) and
    the same model on one device, fp32, the same weights."""
    from forge_cp import CPConfig

    mesh = build_device_mesh({"cp": 2}, "cpu")
    cfg = ModelConfig.preset("debug")
    with torch.device("meta"):
        model, reference = Transformer(cfg), Transformer(cfg)
    plan = ParallelPlan(mesh, param_dtype=torch.float32, cp=CPConfig(variant=variant))
    model = plan.parallelize(model, device="cpu", seed=0)
    reference = ParallelPlan(None, param_dtype=torch.float32).parallelize(
        reference, device="cpu", seed=0
    )
    return mesh, cfg, model, reference


def causal_logits(seq_len: int, changed: int, variant: str = "allgather") -> dict[str, Any]:
    """Logits of a cp=2 model (``[cp] variant``) for a batch and for the same batch with token
    ``changed`` replaced, gathered back into sequence order, next to the single-device model's
    for the batch."""
    import torch.distributed as dist
    from forge_core.contracts import sequence_shard
    from forge_cp import gather_sequence

    mesh, cfg, model, reference = _cp2_and_one_device(variant)
    tokens = torch.randint(
        0, cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(0)
    )
    other = tokens.clone()
    other[:, changed] = (other[:, changed] + 1) % cfg.vocab_size
    shard = sequence_shard(model)
    assert shard is not None
    positions = shard(torch.arange(seq_len)[None])[0]
    out = {}
    with torch.no_grad():
        for name, batch in (("tokens", tokens), ("changed", other)):
            local = model(shard(batch), positions=positions)
            parts = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(parts, local.contiguous(), group=mesh["cp"].get_group())
            out[name] = gather_sequence(parts)
        out["reference"] = reference(tokens)
    out["positions"] = positions
    return out


def capacity_refusal() -> list[str]:
    """What a cp=2 plan, and apply_context_parallel by hand (no expert parallelism after it),
    say of an MoE with the capacity dispatch (2 ranks)."""
    from forge_core import ForgeConfigError
    from forge_cp import apply_context_parallel

    mesh = build_device_mesh({"cp": 2}, "cpu")
    said = []
    for by_hand in (False, True):
        capacity, _ = meta_model(True, moe_dispatch="capacity")
        try:
            if by_hand:
                apply_context_parallel(capacity, mesh)
            else:
                plan = ParallelPlan(mesh, param_dtype=torch.float32)
                plan.parallelize(capacity, device="cpu", seed=0)
            said.append("built")
        except ForgeConfigError as e:
            said.append(str(e))
    return said


def too_long_refusal() -> str:
    """What a cp=2 model says of sequences longer than its rotary tables (2 ranks)."""
    from forge_core.training import forward_backward

    mesh = build_device_mesh({"cp": 2}, "cpu")
    short, cfg = meta_model(False, max_seq_len=32)
    model = ParallelPlan(mesh, param_dtype=torch.float32).parallelize(short, device="cpu", seed=0)
    tokens = synthetic_tokens(0, 1, 2, 48, cfg.vocab_size)[0]  # 48 > 32 tokens per sequence
    try:
        forward_backward(model, tokens, mesh=mesh)
    except Exception as e:  # noqa: BLE001 - the type and the words are what the test checks
        return f"{type(e).__name__}: {e}"
    return "ran"


def cp_on_pipeline_stages() -> dict[str, str]:
    """What a plan with pp=2 x cp=2 and apply_context_parallel on a pipeline stage say (4 ranks)."""
    from forge_core import ForgeConfigError
    from forge_cp import apply_context_parallel
    from forge_pp import PPConfig, pipeline_split

    mesh = build_device_mesh({"pp": 2, "cp": 2}, "cpu")
    said: dict[str, str] = {}
    try:
        ParallelPlan(mesh, param_dtype=torch.float32)
        said["plan"] = "made"
    except ForgeConfigError as e:
        said["plan"] = str(e)
    model, _ = meta_model(False, n_layers=4)
    stage = pipeline_split(model, mesh, PPConfig()).stages[0]
    try:
        apply_context_parallel(stage, mesh)
        said["stage"] = "applied"
    except ForgeConfigError as e:
        said["stage"] = str(e)
    return said


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
    with torch.device("meta"):  # a family forge-cp does not run (Llama, Qwen3, Gemma3 it does)
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small))
    attempt("hugging_face", lambda: apply_context_parallel(hf, mesh))
    return said


def document_logits(variant: str, lengths: list[int]) -> dict[str, Any]:
    """A cp=2 model's logits (``[cp] variant``) for one row of packed documents of ``lengths``,
    dealt over the ranks by their work and put back in the row's order, for the row and for the
    row with its second document changed; and the single-device model's logits of each document
    run alone (2 ranks)."""
    import torch.distributed as dist
    from forge_core.contracts import sequence_shard
    from forge_core.documents import Documents

    mesh, cfg, model, reference = _cp2_and_one_device(variant)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    length = positions.shape[1]
    tokens = torch.randint(
        0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(1)
    )
    other = tokens.clone()
    second = slice(lengths[0], lengths[0] + lengths[1])
    other[:, second] = (other[:, second] + 3) % cfg.vocab_size
    shard = sequence_shard(model)
    mine, index = shard.for_documents(positions)
    docs = Documents(index, (torch.arange(length) - positions)[:, index])
    out: dict[str, Any] = {"index": index}
    with torch.no_grad():
        for name, row in (("tokens", tokens), ("changed", other)):
            local = model(mine(row), positions=mine(positions), documents=docs)
            parts = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(parts, local.contiguous(), group=mesh["cp"].get_group())
            whole = torch.empty(1, length, local.shape[-1])
            whole[:, index] = torch.cat(parts, dim=1)
            out[name] = whole
        alone, at = [], 0
        for n in lengths:
            alone.append(reference(tokens[:, at : at + n]))
            at += n
        out["alone"] = torch.cat(alone, dim=1)
    return out
