"""Hugging Face MoE weights in, sharded: a Hugging Face MoE model built on the meta device from a
directory's config, converted by forge (tp or ep > 1: forge_moe_ep's HFMoE, stacked experts),
parallelized, materialized and filled by ``parallelize(..., weights=DIR)`` gives the logits
``from_pretrained`` gives on one device, each rank reading only the experts it holds from the
checkpoint's per-expert (or fused) tensors. The sources themselves:
packages/forge-moe-ep/tests/test_hf_moe_sources.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from forge.build import ParallelPlan
from forge_core import ForgeConfigError, ParallelismConfig
from forge_core.testing import TINY_HF_DECODER
from forge_mesh import build_device_mesh

transformers = pytest.importorskip("transformers")

#: What this module's rank functions import inside the function (the forkserver imports it once).
RANK_PRELOAD = ["transformers"]

# NOTE: the Hugging Face lane (marker zoo: per-family HF parity), not the README suite (its time).
pytestmark = pytest.mark.zoo

EXPERTS = 8
_TOP2 = {"num_experts_per_tok": 2}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 8,
            "num_experts": EXPERTS,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": EXPERTS, "intermediate_size": 24}),
    "deepseek_v3": (  # MLA, a dense first block, sigmoid routing in groups with correction bias
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "moe_intermediate_size": 16,
            "n_routed_experts": EXPERTS,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "routed_scaling_factor": 2.5,
        },
    ),
    "gpt_oss": (  # fused experts: interleaved gate / up columns, biases; router bias
        "GptOssConfig",
        {"head_dim": 8, "num_local_experts": EXPERTS, "sliding_window": 4},
    ),
}
LAYOUTS = {"dp_shard 2 x tp 2": {"dp_shard": 2, "tp": 2}, "fsdp 2 x ep 2": {"dp_shard": 4, "ep": 2}}
TOKENS = torch.randint(
    0, TINY_HF_DECODER["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3)
)
#: An expert's index in a per-expert tensor name.
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def save_tiny_moe(family: str, directory: Path) -> None:
    """A tiny MoE model of ``family`` with random weights (every tensor moved from its init, the
    zero-initialised routers and biases too: a tensor left unloaded, or routed wrongly, shows)
    saved by ``save_pretrained``."""
    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(**{**TINY_HF_DECODER, **_TOP2, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
    model.save_pretrained(directory)


def _meta_model(directory: str) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class _Recorder:
    """``safetensors.safe_open`` that records ``(tensor name, index)`` of every slice read."""

    def __init__(self, reads: list[tuple[str, Any]]) -> None:
        import safetensors

        self.real, self.reads = safetensors.safe_open, reads

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        recorder, file = self, self.real(*args, **kwargs)

        class File:
            def __enter__(self) -> File:
                file.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                file.__exit__(*exc)

            def __getattr__(self, name: str) -> Any:  # keys(), metadata(): the file's own
                return getattr(file, name)

            def get_slice(self, name: str) -> Any:
                sliced = file.get_slice(name)

                class Slice:
                    def __getattr__(self, attr: str) -> Any:  # get_shape(), get_dtype()
                        return getattr(sliced, attr)

                    def __getitem__(self, index: Any) -> torch.Tensor:
                        recorder.reads.append((name, index))
                        return sliced[index]

                return Slice()

        return File()


def _load(directory: str, layout: dict[str, int]) -> tuple[torch.nn.Module, list[tuple[str, Any]]]:
    """One rank: meta model -> forge's plan (conversion, TP / EP, FSDP2) -> materialize -> load;
    the model and what this rank read."""
    import safetensors

    mesh = build_device_mesh(ParallelismConfig(**layout), "cpu", num_experts=EXPERTS)
    plan = ParallelPlan(mesh, param_dtype=torch.float32)
    reads: list[tuple[str, Any]] = []
    real = safetensors.safe_open
    safetensors.safe_open = _Recorder(reads)
    try:
        model = plan.parallelize(_meta_model(directory), device="cpu", seed=0, weights=directory)
    finally:
        safetensors.safe_open = real
    return model, reads


def _experts_read(reads: list[tuple[str, Any]]) -> set[int]:
    """The experts (of any block) this rank read: by name, or by the rows of a fused tensor."""
    experts: set[int] = set()
    for name, index in reads:
        found = _EXPERT.search(name)
        if found:
            experts.add(int(found.group(1)))
        elif ".experts." in name:
            rows = index[0] if isinstance(index, tuple) else index
            experts.update(range(*rows.indices(EXPERTS)))
    return experts


def _sharded_logits(directories: dict[str, str], layout: dict[str, int]) -> dict[str, Any]:
    """One rank, every family: its logits and the experts it read."""
    out = {}
    for family, directory in directories.items():
        model, reads = _load(directory, layout)
        with torch.no_grad():
            logits = model(TOKENS).logits
        full = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        out[family] = {"logits": full, "experts": _experts_read(reads)}
    return out


def _reference(directory: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_moe_load_equals_from_pretrained_and_reads_only_owned_experts(
    layout, run_on_ranks, tmp_path
):
    directories = {}
    for family in FAMILIES:
        save_tiny_moe(family, tmp_path / family)
        directories[family] = str(tmp_path / family)
    expected = {family: _reference(Path(d)) for family, d in directories.items()}
    outs = run_on_ranks(4, _sharded_logits, directories, LAYOUTS[layout])
    held = EXPERTS // 2 if layout == "dp_shard 2 x tp 2" else EXPERTS // 4  # dim 0 shards
    for rank, out in enumerate(outs):
        for family, result in out.items():
            torch.testing.assert_close(result["logits"], expected[family], rtol=1e-5, atol=1e-5)
            assert len(result["experts"]) == held, (rank, family, result["experts"])


def _reads_under_ep(directory: str) -> dict[str, Any]:
    """One of 2 ranks, ep 2: the experts and the stored expert tensors it read."""
    import torch.distributed as dist

    _, reads = _load(directory, {"dp_shard": 2, "ep": 2})
    names = sorted({name for name, _ in reads if ".experts." in name})
    return {"rank": dist.get_rank(), "experts": _experts_read(reads), "names": names}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # one by one; fused
def test_each_ep_rank_reads_only_its_half_of_the_experts(family, run_on_ranks, tmp_path):
    save_tiny_moe(family, tmp_path)
    for out in run_on_ranks(2, _reads_under_ep, str(tmp_path)):
        half = EXPERTS // 2
        assert out["experts"] == set(range(out["rank"] * half, (out["rank"] + 1) * half)), out
        if family == "qwen3_moe":  # gate, up and down of each of its experts, in both layers
            assert len(out["names"]) == 2 * 3 * half, out["names"]


def _drop_one_expert(directory: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})


def _refusal(directory: str) -> str:
    try:
        _load(directory, {"dp_shard": 2, "ep": 2})
    except ForgeConfigError as err:
        return str(err)
    return "accepted"


MISSING = "model.layers.1.mlp.experts.3.up_proj.weight"


def test_a_checkpoint_missing_one_experts_tensor_is_refused_naming_it(run_on_ranks, tmp_path):
    save_tiny_moe("qwen3_moe", tmp_path)
    _drop_one_expert(tmp_path, MISSING)
    for message in run_on_ranks(2, _refusal, str(tmp_path)):
        assert "\n" not in message and f"lack 1 tensor(s) the model has ({MISSING})" in message


def test_the_pre_launch_check_converts_as_the_layout_will(tmp_path):
    """``[model] hf`` with ep > 1 reads the experts into converted blocks: accepted, and one
    line for a missing expert's tensor; with dp alone the blocks stay transformers' own, whose
    fused experts are not filled from per-expert tensors (yet): refused, one line."""
    from forge.config import load_config
    from forge.kinds import model_kind
    from forge.layout import resolve_layout

    save_tiny_moe("qwen3_moe", tmp_path)

    def problems(parallelism: dict[str, int]) -> list[str]:
        cfg = load_config({"model": {"hf": str(tmp_path)}, "parallelism": parallelism})
        return model_kind(cfg).import_problems(resolve_layout(cfg, 2, device_type="cpu"))

    assert problems({"ep": 2}) == []
    assert problems({"tp": 2, "dp_shard": 1}) == []
    (line,) = problems({})
    assert "hold experts one by one" in line and "not supported yet" in line
    _drop_one_expert(tmp_path, MISSING)
    (line,) = problems({"ep": 2})
    assert line.startswith("model.hf: ") and f"({MISSING})" in line
