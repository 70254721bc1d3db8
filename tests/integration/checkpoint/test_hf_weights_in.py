"""Hugging Face weights in, sharded: a model built on the meta device from a directory's config,
parallelized by forge (FSDP2 x TP on 4 CPU ranks), materialized and filled by
``forge_checkpoint.load_hf_weights`` gives the logits ``from_pretrained`` gives on one device,
while each rank reads only its slices of the safetensors files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from forge.build import ParallelPlan
from forge_core import ParallelismConfig
from forge_core.testing import TINY_HF_DECODER
from forge_mesh import build_device_mesh

transformers = pytest.importorskip("transformers")

#: What this module's rank functions import inside the function (the forkserver imports it once).
RANK_PRELOAD = ["transformers"]

# NOTE: the Hugging Face lane (marker zoo: per-family HF parity), not the README suite (its time).
pytestmark = pytest.mark.zoo

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 4}),
}
TOKENS = torch.randint(
    0, TINY_HF_DECODER["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3)
)


def save_tiny(family: str, directory: Path, max_shard_size: str | None = None) -> None:
    """A tiny model of ``family`` with random weights (not the init's: every tensor moved, so a
    tensor left unloaded shows) saved by ``save_pretrained``, sharded when asked."""
    import transformers

    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(**TINY_HF_DECODER, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)


def _meta_model(directory: str) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _sharded_logits(directory: str, layout: dict[str, int], explicit: bool) -> dict[str, Any]:
    """One rank: meta model -> forge's plan -> materialize -> load; logits and what was read."""
    import safetensors
    from forge_checkpoint import load_hf_weights

    mesh = build_device_mesh(ParallelismConfig(**layout), "cpu")
    plan = ParallelPlan(mesh, param_dtype=torch.float32)
    read: list[int] = []
    real = safetensors.safe_open

    class Counting:  # records the elements of every slice read
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.file = real(*args, **kwargs)

        def __enter__(self) -> Counting:
            self.file.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.file.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:  # keys(), metadata(): the file's own
            return getattr(self.file, name)

        def get_slice(self, name: str) -> Any:
            sliced = self.file.get_slice(name)

            class Slice:
                def __getattr__(self, attr: str) -> Any:  # get_shape(), get_dtype()
                    return getattr(sliced, attr)

                def __getitem__(self, index: Any) -> torch.Tensor:
                    out = sliced[index]
                    read.append(out.numel())
                    return out

            return Slice()

    safetensors.safe_open = Counting
    try:
        if explicit:  # a seeded materialization, then the load
            model = plan.parallelize(_meta_model(directory), device="cpu", seed=0)
            load_hf_weights(model, directory)
        else:  # the load in parallelize: buffers computed, parameters only read
            model = plan.parallelize(_meta_model(directory), device="cpu", weights=directory)
    finally:
        safetensors.safe_open = real
    with torch.no_grad():
        logits = model(TOKENS).logits
    full = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"logits": full, "read": sum(read)}


def _reference(directory: Path) -> tuple[torch.Tensor, int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        logits = model(TOKENS).logits
    return logits, sum(p.numel() for p in model.state_dict().values())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_load_equals_from_pretrained_and_reads_only_owned_slices(
    family, run_on_ranks, tmp_path
):
    save_tiny(family, tmp_path, max_shard_size="20KB" if family == "llama" else None)
    if family == "llama":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    expected, total = _reference(tmp_path)
    explicit = family == "llama"
    outs = run_on_ranks(4, _sharded_logits, str(tmp_path), {"dp_shard": 2, "tp": 2}, explicit)
    for out in outs:
        torch.testing.assert_close(out["logits"], expected, rtol=1e-5, atol=1e-6)
        # each rank's share of the weights is about a quarter (norms are replicated over tp)
        assert 0 < out["read"] < 0.5 * total, (out["read"], total)


def _seeded_params(layout: dict[str, int] | None) -> dict[str, torch.Tensor]:
    """A tiny Gemma 3 on meta (a padding row, tied head, scaled embedding) materialized by forge
    from seed 5, on one process or under ``layout``: every parameter and buffer, whole."""
    import transformers

    name, extra = FAMILIES["gemma3"]
    config = getattr(transformers, name)(**TINY_HF_DECODER, **extra, pad_token_id=1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = build_device_mesh(ParallelismConfig(**layout), "cpu") if layout else None
    model = ParallelPlan(mesh, param_dtype=torch.float32).parallelize(model, device="cpu", seed=5)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.items()
    }


def test_a_seeded_init_is_the_same_sharded_or_not(run_on_ranks):
    """parallelize(meta model, device, seed) fills a Hugging Face model by its own init rules,
    with values that do not depend on the layout (torch 2.11 could not even index a sharded
    embedding's padding row)."""
    one = _seeded_params(None)
    sharded = run_on_ranks(4, _seeded_params, {"dp_shard": 2, "tp": 2})[0]
    assert one.keys() == sharded.keys()
    differ = [name for name, value in one.items() if not torch.equal(sharded[name], value)]
    assert not differ, differ
    embed = one["model.embed_tokens.weight"]
    assert embed[1].abs().sum() == 0 and embed[0].abs().sum() > 0  # the padding row
    assert 0.01 < embed.std() < 0.03  # N(0, initializer_range=0.02)
    assert torch.isfinite(
        one[
            "model.rotary_emb.local_inv_freq"
            if "model.rotary_emb.local_inv_freq" in one
            else next(k for k in one if k.endswith("inv_freq"))
        ]
    ).all()


def test_weights_need_a_device_a_hugging_face_model_and_no_pipeline(tmp_path):
    from forge_core import ForgeConfigError, ModelConfig, Transformer

    save_tiny("llama", tmp_path)
    plan = ParallelPlan(None, param_dtype=torch.float32)
    with pytest.raises(ForgeConfigError, match="pass device= too"):
        plan.parallelize(_meta_model(str(tmp_path)), weights=tmp_path)
    with torch.device("meta"):
        forge_model = Transformer(ModelConfig.preset("debug"))
    with pytest.raises(
        ForgeConfigError, match="loads a Hugging Face model's weights, but this is a Transformer"
    ):
        plan.parallelize(forge_model, device="cpu", weights=tmp_path)
    model = plan.parallelize(_meta_model(str(tmp_path)), device="cpu", weights=tmp_path)
    reference, _ = _reference(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, reference, rtol=1e-5, atol=1e-6)
