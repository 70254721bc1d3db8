"""forge-checkpoint used on its own: the README's example runs, and a save records what a load
needs (step, world size, the optimizer's param groups) next to the caller's state."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from forge_checkpoint.dcp import Checkpointer
from forge_checkpoint.files import STATE_FILE, verify_checkpoint
from forge_core import ModelConfig, Transformer

README = Path(__file__).resolve().parents[1] / "README.md"  # the layer's own, beside tests/
CFG = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_the_readme_example_runs(tmp_path):
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert "/tmp/forge-ckpt-example" in code
    exec(compile(code.replace("/tmp/forge-ckpt-example", str(tmp_path)), str(README), "exec"), {})
    assert (tmp_path / "step-00000001" / "manifest.json").is_file()


def _model_and_optimizer(seed: int) -> tuple[Transformer, torch.optim.Optimizer]:
    model = Transformer(CFG)
    model.init_weights(seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.9))


def test_a_save_records_what_a_load_needs(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = Checkpointer(tmp_path).save(7, model, opt, {"step": 3, "mine": [1, 2]})
    state = json.loads((path / STATE_FILE).read_text())
    assert state["mine"] == [1, 2]
    assert state["step"] == 7  # the checkpoint's own step wins over a stale caller value
    assert state["world_size"] == 1
    assert state["param_groups"][0]["betas"] == [0.8, 0.9]
    verify_checkpoint(path)
    fresh, fresh_opt = _model_and_optimizer(1)
    loaded = Checkpointer(tmp_path).load(path, fresh, fresh_opt)
    assert loaded["rng_restored"] is True
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
