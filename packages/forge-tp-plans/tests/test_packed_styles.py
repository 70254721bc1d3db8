"""Fused-Linear ("packed") and MLA tensor-parallel styles: exact parity with the unsharded model.

``packed_colwise`` / ``packed_rowwise`` (``PackedColwiseLinear`` / ``PackedRowwiseLinear``) on
fused Linears, and ``mla_kv_a_proj`` (``MlaKvAProjReplicated``) on MiniCPM3's and DeepSeek-V2's
MLA, at TP=2 on CPU gloo ranks: outputs and every gradient match the unsharded model, and the
sharded weights' ``full_tensor()`` and the state dict are the unsharded model's (names and
values). Tiny models from configs, random weights, nothing downloaded. Under FSDP2 x TP, composed
with forge-fsdp-wrap: tests/integration/tp_plans/test_packed_styles_with_fsdp2.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from forge_core import ForgeConfigError
from forge_mesh import build_device_mesh
from forge_tp_plans import (
    applied_tp_plan,
    apply_tensor_parallel,
    tp_gradient_mismatches,
    translate_parallel_style,
)
from forge_tp_plans.styles import (
    _REFUSED,
    HF_STYLE_NAMES,
    MlaKvAProjReplicated,
    PackedColwiseLinear,
    PackedRowwiseLinear,
    bind_style,
    describe_style,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

#: What this module's rank functions import inside the function: the rank workers' forkserver
#: imports it once (forge_core.testing.pytest_ranks).
RANK_PRELOAD = ["transformers"]

# NOTE: the Hugging Face lane (marker zoo, with tests/zoo), not the README suite (its time).
pytestmark = pytest.mark.zoo

TP = {"tp": 2, "data": "none"}
COMMON = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}
MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
}


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_grads_match(reference: nn.Module, parallel: nn.Module) -> None:
    grads = {n: _full(p.grad) for n, p in parallel.named_parameters()}
    assert grads.keys() == dict(reference.named_parameters()).keys()
    for n, p in reference.named_parameters():
        assert grads[n] is not None, n
        torch.testing.assert_close(
            grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}"
        )


def _assert_same_state(reference: nn.Module, parallel: nn.Module) -> None:
    """Same state dict names, and every full value bit for bit the unsharded model's."""
    ref, par = reference.state_dict(), parallel.state_dict()
    assert list(par) == list(ref)
    for n, value in ref.items():
        assert torch.equal(_full(par[n]), value), n


# --- no ranks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("packed_colwise", PackedColwiseLinear),
        ("packed_rowwise", PackedRowwiseLinear),
        ("local_packed_rowwise", PackedRowwiseLinear),
        ("mla_kv_a_proj", MlaKvAProjReplicated),
    ],
)
def test_fused_and_mla_styles_translate_instead_of_being_refused(name, cls):
    assert name not in _REFUSED and name in HF_STYLE_NAMES
    style = translate_parallel_style(name)
    assert type(style) is cls
    assert describe_style(style).startswith(cls.__name__)


def test_the_packed_styles_check_module_type_and_sizes():
    fused = nn.Linear(8, 12)
    PackedColwiseLinear().check(fused, "gate_up", 2)  # 12 = 2 parts x 2 ranks x 3
    with pytest.raises(ForgeConfigError, match="'gate_up': out_features 12 must split in 2"):
        PackedColwiseLinear().check(fused, "gate_up", 4)
    with pytest.raises(ForgeConfigError, match="'down': in_features 8 must split in 3"):
        PackedRowwiseLinear(parts=3).check(fused, "down", 2)
    with pytest.raises(ForgeConfigError, match="splits nn.Linear modules only"):
        PackedColwiseLinear().check(nn.Embedding(4, 8), "experts", 2)


def test_mla_style_reads_the_rope_dim_from_the_model():
    import transformers as tf

    model = tf.MiniCPM3ForCausalLM(tf.MiniCPM3Config(**COMMON, **MLA, q_lora_rank=16))
    fqn = "model.layers.1.self_attn.kv_a_proj_with_mqa"
    unbound = translate_parallel_style("mla_kv_a_proj")
    bound = bind_style(unbound, model, fqn)
    assert isinstance(bound, MlaKvAProjReplicated) and bound.rope_dim == MLA["qk_rope_head_dim"]
    assert describe_style(bound) == "MlaKvAProjReplicated(rope dim 4)"
    with pytest.raises(ForgeConfigError, match="qk_rope_head_dim is not known"):
        unbound.check(model.get_submodule(fqn), fqn, 2)
    with pytest.raises(ForgeConfigError, match="needs qk_rope_head_dim"):
        bind_style(unbound, nn.Sequential(nn.Linear(4, 4)), "0")
    with pytest.raises(ForgeConfigError, match="must be less than out_features 4"):
        MlaKvAProjReplicated(rope_dim=4).check(nn.Linear(4, 4), "kv_a", 2)
    plain = translate_parallel_style("colwise")
    assert bind_style(plain, model, fqn) is plain


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_the_all_to_all_plan_moves_every_block_to_its_packed_place_and_back(tp, parts):
    """The packed layout is ``parts`` equal row segments, each split over tp: the all-to-all
    (forge_tp_plans.fused_styles) played out without ranks gives each rank its slice of every
    part, in order (rank r: blocks r, tp + r, ...), and the way back returns every row to the
    rank that holds it contiguously."""
    from forge_tp_plans.row_segments import exchange

    size = 2  # rows of one block (one part's slice on one rank)
    c = size * parts  # rows a rank holds
    plans = [exchange(((size * tp, True),) * parts, tp, r) for r in range(tp)]
    # what each rank sends to each other one, in order (an all_to_all_single)
    outbox = []
    for r, ex in enumerate(plans):
        sent, start = [r * c + s + i for s, n in ex.send for i in range(n)], 0
        outbox.append([sent[start : (start := start + k)] for k in ex.send_counts])
    packed = []
    for r, ex in enumerate(plans):
        assert [len(outbox[s][r]) for s in range(tp)] == list(ex.recv_counts)
        packed.append([k for s in range(tp) for k in outbox[s][r]])
        blocks = [p * tp + r for p in range(parts)]  # its slice of every part
        assert packed[r] == [k * size + i for k in blocks for i in range(size)]
    for s, ex in enumerate(plans):  # back: each rank returns what it got from s, in order
        back = []
        for r in range(tp):
            start = sum(plans[r].recv_counts[:s])
            back += packed[r][start : start + plans[r].recv_counts[s]]
        restored, pos = [-1] * c, 0
        for start, n in ex.send:
            restored[start : start + n], pos = back[pos : pos + n], pos + n
        assert restored == list(range(s * c, (s + 1) * c))


# --- a fused GLU: packed_colwise into packed_rowwise -----------------------------------------


class FusedGLU(nn.Module):
    """``parts`` projections fused in ``gate_up`` and a ``down`` projection fed ``parts`` pieces
    end to end: each tp rank's pieces come from its own slices of every part."""

    def __init__(self, parts: int, dim: int = 32, hidden: int = 8, bias: bool = True) -> None:
        super().__init__()
        self.parts = parts
        self.gate_up = nn.Linear(dim, parts * hidden, bias=bias)
        self.down = nn.Linear(parts * hidden, dim, bias=bias)

    def mix(self, fused: torch.Tensor) -> torch.Tensor:
        pieces = fused.chunk(self.parts, dim=-1)
        return torch.cat([F.silu(pieces[0]) * pieces[-1], *pieces[1:]], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.mix(self.gate_up(x)))


def _fused_glu_parity(parts: int, bias: bool) -> dict:
    torch.manual_seed(0)
    reference = FusedGLU(parts, bias=bias)
    parallel = copy.deepcopy(reference)
    mesh = build_device_mesh(TP, "cpu")
    plan = {"gate_up": PackedColwiseLinear(parts=parts), "down": PackedRowwiseLinear(parts=parts)}
    if parts == 2:
        plan = {"gate_up": "packed_colwise", "down": "packed_rowwise"}  # the HF names
    apply_tensor_parallel(parallel, mesh, plan=plan)
    rank, tp = mesh["tp"].get_local_rank(), 2

    # Stored as plain Shard DTensors of the unsharded values: state dicts agree.
    weights = {n: p for n, p in parallel.named_parameters()}
    assert weights["gate_up.weight"].placements == (Shard(0),)
    assert weights["down.weight"].placements == (Shard(1),)
    if bias:
        assert weights["gate_up.bias"].placements == (Shard(0),)
        assert weights["down.bias"].placements == (Replicate(),)
    _assert_same_state(reference, parallel)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 32, generator=gen)
    probe = torch.randn(2, 5, 32, generator=gen)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()

    # The packed layout: this rank's slice of every part of the unsharded output, in order.
    fused_ref = reference.gate_up(x)
    size = fused_ref.shape[-1] // parts // tp
    expected = torch.cat(
        [p[..., rank * size : (rank + 1) * size] for p in fused_ref.chunk(parts, -1)], -1
    )
    torch.testing.assert_close(parallel.gate_up(x), expected, rtol=1e-6, atol=1e-6)

    out_ref, out_par = reference(x_ref), parallel(x_par)
    torch.testing.assert_close(out_par, out_ref, rtol=1e-5, atol=1e-5)
    (out_ref * probe).sum().backward()
    (out_par * probe).sum().backward()
    torch.testing.assert_close(x_par.grad, x_ref.grad, rtol=1e-4, atol=1e-6)
    _assert_grads_match(reference, parallel)

    # A DTensor input to the row-parallel layer is taken in torch's contiguous layout.
    hidden = reference.mix(fused_ref).detach()
    h_ref, h_par = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    y_ref = reference.down(h_ref)
    y_par = parallel.down(DTensor.from_local(h_par, mesh["tp"], [Replicate()]))
    torch.testing.assert_close(y_par, y_ref, rtol=1e-5, atol=1e-5)
    (y_ref * probe).sum().backward()
    (y_par * probe).sum().backward()
    torch.testing.assert_close(h_par.grad, h_ref.grad, rtol=1e-4, atol=1e-6)
    return applied_tp_plan(parallel).styles


@pytest.mark.parametrize(
    ("parts", "bias"),
    # parts=3 over 2 ranks: rank 0 sends two of its blocks to itself, one to rank 1
    [(2, True), (2, False), (3, True)],
)
def test_fused_glu_tp2_packed_weights_outputs_and_grads_match(run_on_ranks, parts, bias):
    styles = run_on_ranks(2, _fused_glu_parity, parts, bias)[0]
    assert styles == {
        "gate_up": f"PackedColwiseLinear(parts {parts})",
        "down": f"PackedRowwiseLinear(parts {parts})",
    }


# --- Hugging Face models ---------------------------------------------------------------------


def _build(name: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "phi3":
        model = tf.Phi3ForCausalLM(
            tf.Phi3Config(
                **COMMON, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2
            )
        )
        # No dense family's own plan packs a Linear (transformers 5.23 uses packed_colwise on
        # MoE expert parameters only): Phi3's fused mlp.gate_up_proj with the inner model's plan
        # changed from "gather the output" to packed_colwise + rowwise.
        inner = model.model
        inner._tp_plan = {
            **(inner._tp_plan or {}),
            "layers.*.mlp.gate_up_proj": "packed_colwise",
            "layers.*.mlp.down_proj": "rowwise",
        }
    elif name == "minicpm3":  # q_a_proj -> q_b_proj
        model = tf.MiniCPM3ForCausalLM(tf.MiniCPM3Config(**COMMON, **MLA, q_lora_rank=16))
    elif name == "deepseek_v2":  # q_proj; every layer dense (first_k_dense_replace)
        model = tf.DeepseekV2ForCausalLM(
            tf.DeepseekV2Config(
                **COMMON,
                **MLA,
                q_lora_rank=None,
                first_k_dense_replace=COMMON["num_hidden_layers"],
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
            )
        )
    else:
        raise ValueError(name)
    return model.float()


def _bound_hf_plan(model: nn.Module) -> dict:
    """The model's own plan, as an explicit plan, with ``mla_kv_a_proj`` given its rope dim
    (what ``bind_style`` does from the model) and the patterns that match no module left out."""
    from forge_tp_plans.plans import _hf_plan, unmatched_patterns

    plan = _hf_plan(model)
    rope = model.config.qk_rope_head_dim
    skipped = set(unmatched_patterns(model, plan))
    return {
        k: MlaKvAProjReplicated(rope_dim=rope) if v == "mla_kv_a_proj" else v
        for k, v in plan.items()
        if k not in skipped
    }


def _hf_parity(
    name: str,
    layout: dict,
    explicit: bool,
    shard: Callable[[nn.Module, DeviceMesh], None] | None = None,
) -> dict:
    """``shard``: a data-parallel wrap applied after TP (FSDP2 in
    tests/integration/tp_plans/test_packed_styles_with_fsdp2.py)."""
    reference = _build(name)
    parallel = copy.deepcopy(reference)
    mesh = build_device_mesh(layout, "cpu")
    apply_tensor_parallel(parallel, mesh, plan=_bound_hf_plan(parallel) if explicit else None)
    applied = applied_tp_plan(parallel)
    _assert_same_state(reference, parallel)
    if shard is not None:
        shard(parallel, mesh)
    tokens = torch.randint(
        0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
    )
    ref_out = reference(tokens, labels=tokens)
    par_out = parallel(tokens, labels=tokens)
    torch.testing.assert_close(par_out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    ref_out.loss.backward()
    par_out.loss.backward()
    _assert_grads_match(reference, parallel)
    # The replicated parameters (MLA's kv_a_proj_with_mqa among them) agree across tp ranks.
    assert tp_gradient_mismatches(parallel, mesh) == []
    return {"source": applied.source, "styles": applied.styles, "skipped": list(applied.skipped)}


def test_phi3_packed_gate_up_tp2_logits_and_grads_match(run_on_ranks):
    out = run_on_ranks(2, _hf_parity, "phi3", TP, False)[0]
    assert out["source"] == "huggingface"
    assert out["styles"]["model.layers.0.mlp.gate_up_proj"] == "PackedColwiseLinear(parts 2)"
    assert out["styles"]["model.layers.1.mlp.down_proj"].startswith("RowwiseParallel")


@pytest.mark.parametrize("name", ["minicpm3", "deepseek_v2"])
def test_mla_tp2_logits_and_grads_match(run_on_ranks, name):
    out = run_on_ranks(2, _hf_parity, name, TP, True)[0]
    mla = out["styles"]["model.layers.1.self_attn.kv_a_proj_with_mqa"]
    assert mla == "MlaKvAProjReplicated(rope dim 4)"
    assert out["styles"]["model.layers.1.self_attn.kv_b_proj"].startswith("ColwiseParallel")


@pytest.mark.parametrize("name", ["minicpm3", "deepseek_v2"])
def test_mla_through_the_models_own_plan_tp2_matches(run_on_ranks, name):
    out = run_on_ranks(2, _hf_parity, name, TP, False)[0]
    assert out["source"] == "huggingface"
    assert out["styles"]["model.layers.0.self_attn.kv_a_proj_with_mqa"].startswith(
        "MlaKvAProjReplicated(rope dim 4)"
    )
    if name == "deepseek_v2":  # MoE expert patterns of a dense config: skipped as before
        assert "model.layers.*.mlp.experts.gate_up_proj" in out["skipped"]
