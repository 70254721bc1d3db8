"""ParallelPlan as a config-object entry point, whole-model compile, and the HF packed-sequence patch.

- ``ParallelPlan.from_config(cfg, mesh).parallelize(model)`` on a model the user already has (a
  tiny Hugging Face Llama with random weights, FSDP2 x TP on 4 gloo ranks) trains like the
  single-device model: same loss and gradient norm at every step (fp32 tolerances).
- ``from_config`` is the mapping ``forge build`` uses: on the reference Transformer it gives the
  same plan, stages, shards and logits as ``build_parallel_model`` with the same options.
- ``maybe_compile`` in both compile scopes (aot_eager) matches the single-device model.
- ``forge.hf_patches``: transformers' real ``_flash_attention_forward`` (flash kernels replaced
  by an SDPA stand-in so it runs on CPU) syncs the host once per call through
  ``_is_packed_sequence``; patched, it does not, and computes the same output.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import forge_float8.checks
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from forge import load_config
from forge.build import ParallelPlan, build_meta_model, build_parallel_model, check_float8
from forge.hf_patches import (
    is_hf_model,
    is_packed_sequence_patched,
    no_packed_sequence_sync,
    restore_packed_sequence_check,
    skip_packed_sequence_check,
)
from forge_core import ForgeConfigError, applied_stages, count_host_syncs
from forge_core.testing import run_parity
from forge_float8 import Float8Config
from forge_mesh import build_device_mesh
from forge_tp_plans import describe_tp_plan
from forge_vlm import VLMConfig
from torch.distributed.tensor import DTensor

from tests.parity_jobs import TINY_HF_DECODER, HFLogits

LLAMA = TINY_HF_DECODER


def _llama() -> nn.Module:
    """A tiny Hugging Face Llama from a config: random weights, the same on every rank."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).float()


# --- from_config on a Hugging Face model the user already has -----------------------------------


def _hf_from_config_parity(config_path: str) -> dict[str, Any]:
    cfg = load_config(config_path)
    mesh = build_device_mesh(cfg.parallelism, "cpu")
    reference = _llama()
    plan = ParallelPlan.from_config(config_path, mesh)  # the path itself: load_config inside
    parallel = plan.parallelize(copy.deepcopy(reference))  # materialized: values kept, no device
    result = run_parity(
        HFLogits(reference), HFLogits(parallel), mesh=mesh, steps=5, vocab_size=LLAMA["vocab_size"]
    )
    return {
        "result": result,
        "data": plan.data,
        "stages": applied_stages(parallel),
        "tp": describe_tp_plan(parallel),
        "param_dtype": plan.param_dtype,
    }


def test_from_config_parallelizes_an_hf_llama_fsdp2_x_tp_like_one_device(run_on_ranks, tmp_path):
    path = tmp_path / "hf.toml"
    path.write_text('[parallelism]\ntp = 2\n\n[training]\nparam_dtype = "float32"\n')
    outs = run_on_ranks(4, _hf_from_config_parity, str(path))
    for out in outs:
        out["result"].assert_ok()  # loss and grad norm, every step, fp32 tolerances
    out = outs[0]
    assert out["data"] == "fsdp2" and out["param_dtype"] == torch.float32
    assert out["stages"] == ["tp", "fsdp2"]
    assert out["tp"].startswith("huggingface plan over 2 ranks"), out["tp"]
    assert len(out["result"].parallel) == 5


def _default_data_modes(_: None) -> dict[str, Any]:
    from forge_core import ParallelismConfig

    dp = ParallelPlan(build_device_mesh(ParallelismConfig(dp_shard=2), "cpu"))
    return {"dp": (dp.data, dp.data_mode)}


def test_a_plan_keeps_the_data_it_was_given_and_derives_the_mode(run_on_ranks):
    """``data=None`` stays None on the frozen plan (nothing rewrites a field); ``data_mode`` is
    fsdp2 over a data-parallel mesh, none on one device; a changed copy derives it again."""
    out = run_on_ranks(2, _default_data_modes, None)[0]
    assert out["dp"] == (None, "fsdp2")
    one = ParallelPlan(None)
    assert (one.data, one.data_mode) == (None, "none")
    assert replace(one, data="none").data_mode == "none"
    with pytest.raises(ForgeConfigError, match="needs a mesh with a data-parallel axis"):
        replace(one, data="fsdp2")


# --- from_config is the mapping forge build uses ------------------------------------------------


def _from_config_vs_build_parallel_model() -> dict[str, Any]:
    cfg = load_config(
        {
            "parallelism": {"tp": 2},
            "training": {"ac_mode": "selective", "param_dtype": "float32"},
            "tp": {"loss_parallel": True},
        }
    )
    mesh = build_device_mesh(cfg.resolved_parallelism(4), "cpu")
    plan = ParallelPlan.from_config(cfg, mesh)
    expected = ParallelPlan(
        mesh,
        data="fsdp2",
        ac_mode="selective",
        param_dtype=torch.float32,
        loss_parallel=True,
        allow_plan_import=(),
    )
    ours = plan.maybe_compile(plan.parallelize(build_meta_model(cfg.decoder), device="cpu", seed=0))
    theirs = build_parallel_model(
        cfg.decoder,
        "cpu",
        mesh,
        ac_mode="selective",
        param_dtype=torch.float32,
        loss_parallel=True,
    )
    same_shards = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
    )
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3)
    )
    logits_ours, logits_theirs = ours(tokens), theirs(tokens)
    try:  # a config whose [parallelism] does not describe this mesh
        ParallelPlan.from_config({"training": {"param_dtype": "float32"}}, mesh)
        mismatch = ""
    except ForgeConfigError as e:
        mismatch = str(e)
    return {
        "plan_equal": plan == expected,
        "stages": (applied_stages(ours), applied_stages(theirs)),
        "tp": (describe_tp_plan(ours), describe_tp_plan(theirs)),
        "same_shards": same_shards,
        "dtensor_logits": isinstance(logits_ours, DTensor),
        "same_logits": torch.equal(logits_ours.to_local(), logits_theirs.to_local()),
        "mismatch": mismatch,
    }


def test_from_config_equals_build_parallel_model_on_the_reference_transformer(run_on_ranks):
    for out in run_on_ranks(4, _from_config_vs_build_parallel_model):
        assert out["plan_equal"]
        ours, theirs = out["stages"]
        assert ours == theirs == ["tp", "ac", "fsdp2"]
        assert out["tp"][0] == out["tp"][1] and "loss_parallel" in out["tp"][0]
        assert out["same_shards"] and out["dtensor_logits"] and out["same_logits"]
        assert "dp_shard=4, tp=1 on 4 rank(s)" in out["mismatch"], out["mismatch"]
        assert "parallelism.dp_shard=2, parallelism.tp=2" in out["mismatch"]


def test_from_config_maps_float8_vlm_training_and_tp_sections(tmp_path, monkeypatch):
    # NOTE: the mapping does not need torchao; whether it imports is checked on its own below.
    monkeypatch.setattr(forge_float8.checks, "check_torchao", lambda: None)
    raw = {
        "model": {"preset": "debug_vlm"},
        "training": {
            "ac_mode": "full",
            "compile": True,
            "compile_scope": "model",
            "param_dtype": "bfloat16",
            "reshard_after_forward": False,
            "cpu_offload": True,
        },
        "tp": {"sequence_parallel": False, "loss_parallel": True, "allow_import": ["my_plans"]},
        "float8": {"enabled": True, "recipe": "rowwise", "filter_fqns": ["output"]},
        "vlm": {
            "freeze_encoder": True,
            "encoder_tp": True,
            "encoder_tp_plan": "my_plans:ENC",
            "ac_scope": "language",
            "shard_frozen_encoder": True,
        },
    }
    expected = ParallelPlan(
        None,
        data="none",  # no mesh: one device
        ac_mode="full",
        compile_model=True,
        compile_scope="model",
        param_dtype=torch.bfloat16,
        reshard_after_forward=False,
        cpu_offload=True,
        sequence_parallel=False,
        loss_parallel=False,  # the layout's: tp=1 here, so no loss parallelism
        allow_plan_import=("my_plans",),
        # the layout's resolved fp8 all-gather ("auto": off for rowwise, and without FSDP2)
        float8=Float8Config(
            enabled=True, recipe="rowwise", fsdp_float8_all_gather=False, filter_fqns=("output",)
        ),
        vlm=VLMConfig(
            freeze_encoder=True,
            encoder_tp=True,
            encoder_tp_plan="my_plans:ENC",
            ac_scope="language",
            shard_frozen_encoder=True,
        ),
    )
    assert ParallelPlan.from_config(raw, None) == expected  # a dict
    assert expected.ac_components == ("decoder",)  # ac_scope "language": the decoder
    assert ParallelPlan.from_config(load_config(raw), None) == expected  # a ForgeConfig
    # fields the config has no key for, as keywords
    plan = ParallelPlan.from_config(raw, None, compile_backend="aot_eager", packed_sequences=False)
    assert (plan.compile_backend, plan.packed_sequences) == ("aot_eager", False)
    with pytest.raises(ForgeConfigError, match="did you mean 'compile_backend'"):
        ParallelPlan.from_config(raw, None, compile_backnd="aot_eager")
    with pytest.raises(ForgeConfigError, match=r"device_mesh=None \(one device\)"):
        ParallelPlan.from_config({"parallelism": {"tp": 2}}, None)
    # the float8 checks from_config runs (forge build's check_config runs the same function)
    fp8_gather = load_config({"float8": {"enabled": True, "fsdp_float8_all_gather": True}}).float8
    check_float8(fp8_gather, 1)
    with pytest.raises(ForgeConfigError, match="fsdp_float8_all_gather=true with tp > 1"):
        check_float8(fp8_gather, 2)
    with pytest.raises(ForgeConfigError, match="does not exist"):
        ParallelPlan.from_config(tmp_path / "missing.toml", None)
    with pytest.raises(ForgeConfigError, match="pass a ForgeConfig, a dict"):
        ParallelPlan.from_config(42, None)  # type: ignore[arg-type]


def test_float8_without_torchao_is_refused_by_the_pre_launch_check(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    fp8 = load_config({"float8": {"enabled": True}}).float8
    with pytest.raises(ForgeConfigError, match=r"float8.enabled=true needs torchao.*pip install"):
        check_float8(fp8, 1)
    check_float8(load_config({}).float8, 1)  # Float8 off: torchao not needed


# --- compile scopes -----------------------------------------------------------------------------


def _compiled_scope_parity(scope: str) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    # NOTE: the rank pool's processes live across tests: start from empty dynamo caches, so a
    # code object compiled by another test (Module._call_impl) does not hit its recompile limit.
    torch._dynamo.reset()
    cfg = load_config(
        {"training": {"compile": True, "compile_scope": scope, "param_dtype": "float32"}}
    )
    mesh = build_device_mesh(cfg.resolved_parallelism(2), "cpu")
    plan = ParallelPlan.from_config(cfg, mesh, compile_backend="aot_eager")
    model = plan.parallelize(build_meta_model(cfg.decoder), device="cpu", seed=0)
    stages = applied_stages(model)
    model = plan.maybe_compile(model)
    compiled_call = model._compiled_call_impl
    again = plan.maybe_compile(model)  # must not compile a second time
    counters.clear()
    reference = build_parallel_model(cfg.decoder, "cpu", None, param_dtype=torch.float32)
    result = run_parity(reference, model, mesh=mesh, steps=3, batch_size=4, seq_len=16)
    return {
        "result": result,
        "stages": stages,
        "whole_model_compiled": compiled_call is not None,
        "same_object": again is model and model._compiled_call_impl is compiled_call,
        "graphs": counters["stats"]["unique_graphs"],
        "counters": {k: dict(v) for k, v in counters.items()},
    }


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_maybe_compile_in_both_scopes_matches_single_device(run_on_ranks, scope):
    outs = run_on_ranks(2, _compiled_scope_parity, scope)
    for out in outs:
        out["result"].assert_ok()
        assert out["same_object"]
        assert out["graphs"] > 0, out["counters"]  # something really ran compiled
    out = outs[0]
    if scope == "blocks":
        assert out["stages"] == ["compile", "fsdp2"] and not out["whole_model_compiled"]
    else:
        assert out["stages"] == ["fsdp2"] and out["whole_model_compiled"]


def test_bad_compile_scope_is_refused():
    with pytest.raises(ForgeConfigError, match=r"compile_scope='layers' is invalid.*'blocks'"):
        ParallelPlan(None, compile_scope="layers")
    with pytest.raises(ForgeConfigError, match=r"training.compile_scope='modle'.*did you mean"):
        load_config({"training": {"compile_scope": "modle"}})
    with pytest.raises(ForgeConfigError, match="training.compile_scope"):
        ParallelPlan.from_config({"training": {"compile_scope": "block"}}, None)


def test_maybe_compile_is_a_no_op_when_off_and_never_compiles_twice():
    layer = nn.Linear(4, 4)
    assert ParallelPlan(None, param_dtype=torch.float32).maybe_compile(layer) is layer
    assert layer._compiled_call_impl is None
    whole = ParallelPlan(
        None,
        compile_model=True,
        compile_scope="model",
        compile_backend="aot_eager",
        param_dtype=torch.float32,
    )
    assert whole.maybe_compile(layer) is layer
    first = layer._compiled_call_impl
    assert first is not None and whole.maybe_compile(layer)._compiled_call_impl is first
    opt = torch.compile(nn.Linear(4, 4), backend="aot_eager")
    assert whole.maybe_compile(opt) is opt  # torch.compile'd already: left alone
    blocks = ParallelPlan(
        None, compile_model=True, compile_backend="aot_eager", param_dtype=torch.float32
    )
    with pytest.raises(ForgeConfigError, match="call plan.maybe_compile\\(plan.parallelize"):
        blocks.maybe_compile(nn.Linear(4, 4))  # parallelize (which compiles blocks) never ran


def test_parallelize_refuses_device_for_a_model_that_already_has_values():
    with pytest.raises(ForgeConfigError, match="without device"):
        ParallelPlan(None, param_dtype=torch.float32).parallelize(nn.Linear(4, 4), device="cpu")


# --- transformers' packed-sequence sync ---------------------------------------------------------


def _sdpa_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    **_: Any,
) -> torch.Tensor:
    """flash_attn_func's contract ((batch, seq, heads, head_dim) in and out) on torch SDPA."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=softmax_scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def _flash_kwargs(*, is_causal: bool, softmax_scale: float | None = None, **_: Any) -> dict:
    return {"causal": is_causal, "softmax_scale": softmax_scale}


class _KwargsFns(tuple):
    """What ``lazy_import_flash_attention`` returns second, in either shape transformers used:
    the process-kwargs function itself (5.17) or a pair (process-kwargs, process-kvcache-kwargs)
    that is unpacked (5.23)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self[0](*args, **kwargs)


@pytest.fixture
def flash_utils(monkeypatch) -> Iterator[Any]:
    """transformers' flash-attention utilities, with the flash kernels replaced by SDPA.

    ``lazy_import_flash_attention`` returns ``((flash_fn, varlen_fn, kvcache_fn, pad_fn,
    unpad_fn), kwargs_fns)`` (see :class:`_KwargsFns`); only ``flash_fn`` and the
    process-kwargs function are reached for an unpadded batch of one without packing.
    """
    import transformers.modeling_flash_attention_utils as mfau

    def stub(*_: Any, **__: Any) -> tuple[tuple, _KwargsFns]:
        return (_sdpa_flash, None, None, None, None), _KwargsFns((_flash_kwargs, dict))

    original = mfau._is_packed_sequence
    monkeypatch.setattr(mfau, "lazy_import_flash_attention", stub)
    yield mfau
    assert mfau._is_packed_sequence is original  # nothing stays replaced


def _attention_calls(mfau: Any, calls: int) -> tuple[int, dict[str, int], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, h, 8, generator=g) for h in (4, 2, 2))
    position_ids = torch.arange(12)[None]
    with count_host_syncs("cpu") as syncs:
        for _ in range(calls):
            out = mfau._flash_attention_forward(q, k, v, None, 12, True, position_ids=position_ids)
    return syncs.count, dict(syncs.ops), out


def test_hf_flash_attention_syncs_per_call_unless_replaced_in_a_block(flash_utils):
    original = flash_utils._is_packed_sequence
    count, ops, unreplaced_out = _attention_calls(flash_utils, 4)
    assert count == 4 and ops == {"aten._local_scalar_dense": 4}  # one sync per call
    with no_packed_sequence_sync() as active:
        assert active and is_packed_sequence_patched()
        with no_packed_sequence_sync() as inner:  # nested: the inner block restores nothing
            assert inner
        assert is_packed_sequence_patched()
        count, ops, replaced_out = _attention_calls(flash_utils, 4)
    assert count == 0 and ops == {}
    assert torch.equal(replaced_out, unreplaced_out)
    assert flash_utils._is_packed_sequence is original and not is_packed_sequence_patched()
    assert _attention_calls(flash_utils, 2)[0] == 2


def test_no_replacement_without_transformers_or_the_function(monkeypatch, flash_utils):
    monkeypatch.delattr(flash_utils, "_is_packed_sequence")
    with no_packed_sequence_sync() as active:
        assert active is False
    assert skip_packed_sequence_check(HFLogits(_llama())) is False
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "transformers.modeling_flash_attention_utils", None)
    with no_packed_sequence_sync() as active:
        assert active is False
    assert is_packed_sequence_patched() is False


def test_plan_hooks_an_hf_model_only_when_told_sequences_are_not_packed(flash_utils):
    original = flash_utils._is_packed_sequence
    fp32 = {"param_dtype": torch.float32}
    tokens = torch.arange(8)[None]
    ParallelPlan(None, **fp32).parallelize(default := HFLogits(_llama()))
    assert not skip_packed_sequence_check(nn.Linear(4, 4))  # not an HF model: nothing to hook
    assert not is_hf_model(nn.Linear(4, 4))
    ParallelPlan(None, packed_sequences=False, **fp32).parallelize(nn.Linear(4, 4))
    assert not restore_packed_sequence_check(default)  # the default plan hooked nothing

    model = HFLogits(_llama())  # an HF model inside a wrapper
    ParallelPlan(None, packed_sequences=False, ac_mode="full", **fp32).parallelize(model)
    assert flash_utils._is_packed_sequence is original  # nothing replaced outside the calls
    seen: list[bool] = []
    attention = model.model.model.layers[0].self_attn
    attention.register_forward_pre_hook(lambda *_: seen.append(is_packed_sequence_patched()))
    model(tokens).sum().backward()
    # the forward, then the recompute of the checkpointed block in backward (outside the
    # model's forward): the hooks on each attention module cover it
    assert seen == [True, True] and flash_utils._is_packed_sequence is original
    with pytest.raises(ForgeConfigError, match="packed_sequences=True"):
        ParallelPlan(None, packed_sequences=True, **fp32).parallelize(model)
    # packed rows on the hooked model: refused in one line before any forward, not run with
    # attention across the documents
    from forge_core.training import forward_backward

    packed_rows = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    for hooked in (model, model.model):  # the wrapper, and the Hugging Face model inside it
        with pytest.raises(ForgeConfigError, match="cannot keep attention inside them: transf"):
            forward_backward(hooked, torch.arange(8)[None], mesh=None, positions_BS=packed_rows)
    assert restore_packed_sequence_check(model)
    forward_backward(model.model, torch.arange(8)[None], mesh=None, positions_BS=packed_rows)
    seen.clear()
    model(tokens).sum().backward()
    assert seen == [False, False]
    ParallelPlan(None, packed_sequences=True, **fp32).parallelize(model)  # fine now
    assert flash_utils._is_packed_sequence is original


# --- AC on a Hugging Face model: transformers' KV cache off ------------------------------------


def _hf_ac_parity(ac_mode: str) -> dict[str, Any]:
    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    reference = _llama()
    parallel = copy.deepcopy(reference)
    assert parallel.config.use_cache  # transformers' default
    plan = ParallelPlan(mesh, ac_mode=ac_mode, param_dtype=torch.float32)
    parallel = plan.parallelize(parallel)
    result = run_parity(
        HFLogits(reference), HFLogits(parallel), mesh=mesh, steps=3, vocab_size=LLAMA["vocab_size"]
    )
    return {"result": result, "use_cache": parallel.config.use_cache}


@pytest.mark.parametrize("ac_mode", ["op"])  # NOTE: op AC is the one that failed; full: by hand
def test_ac_turns_a_hugging_face_models_kv_cache_off_and_matches_one_device(run_on_ranks, ac_mode):
    # With transformers' default use_cache=True the forward builds a KV cache, which AC's
    # recomputation does not reproduce (op AC: "aten.slice.Tensor ... not found in storage").
    for out in run_on_ranks(2, _hf_ac_parity, ac_mode):
        out["result"].assert_ok()
        assert out["use_cache"] is False


def _ep_on_a_dense_model() -> str:
    mesh = build_device_mesh({"dp_shard": 2, "ep": 2}, "cpu", num_experts=4)
    try:
        ParallelPlan(mesh).parallelize(_llama())
    except ForgeConfigError as err:
        return str(err)
    return "accepted"


def test_an_ep_axis_on_a_model_without_moe_is_refused_in_the_layers_words(run_on_ranks):
    """ParallelPlan leaves the refusal to forge-moe-ep (one wording for the config, the plan and
    apply_expert_parallel), on a Hugging Face dense model too."""
    message = run_on_ranks(2, _ep_on_a_dense_model)[0]
    assert message.startswith(
        "expert parallelism (parallelism.ep=2) on a model with no forge_moe_ep.MoE layer"
    ), message
