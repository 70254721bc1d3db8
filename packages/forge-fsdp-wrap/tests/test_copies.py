"""An optimizer never steps FSDP2's unsharded copies (forge_fsdp_wrap.copies), for a direct
``apply_fsdp2`` user: built after a forward that no backward followed, its first step stops with
one line; after ``forge_fsdp_wrap.reshard(model)`` it holds the shards and trains them; the
parameters left out of FSDP2 (a replicated frozen component) are never taken for copies.
(Each model kind through forge's composition: tests/integration/test_eval_forward.py.)"""

from __future__ import annotations

import torch
import torch.nn as nn
from forge_core import ForgeConfigError, ModelConfig, Transformer
from forge_core.contracts import declare_components
from forge_core.training import forward_backward, local_batch, synthetic_tokens
from forge_fsdp_wrap import apply_fsdp2, default_mp_policy, reshard, unshard_fsdp2_model
from forge_fsdp_wrap.copies import COPY_MARK
from forge_mesh import build_device_mesh
from torch.distributed.tensor import DTensor

CFG = ModelConfig.preset("debug")
LINE = "this optimizer holds FSDP2's unsharded copies of"


def _sharded() -> nn.Module:
    with torch.device("meta"):
        model = Transformer(CFG)
    apply_fsdp2(model, build_device_mesh({}, "cpu"), default_mp_policy(torch.float32))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    mesh = build_device_mesh({}, "cpu")
    tokens = synthetic_tokens(0, 1, 4, 16, CFG.vocab_size)[0]
    forward_backward(model, local_batch(tokens, mesh), mesh=mesh)
    try:
        optimizer.step()
    except ForgeConfigError as e:
        return str(e)
    return "stepped"


def _shard_values(model: nn.Module) -> list[torch.Tensor]:
    reshard(model)
    return [p.to_local().clone() for p in model.parameters() if isinstance(p, DTensor)]


def _optimizer_after_an_evaluation_forward() -> dict:
    model = _sharded()
    before = _shard_values(model)
    model(torch.randint(0, CFG.vocab_size, (2, 8))).sum()  # an evaluation: no backward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    message = _one_step(model, optimizer)
    after = _shard_values(model)
    unchanged = len(after) == len(before) and all(map(torch.equal, before, after))
    return {"message": message, "unchanged": unchanged}


def test_an_optimizer_built_after_an_evaluation_forward_stops_at_its_first_step(run_on_ranks):
    out = run_on_ranks(2, _optimizer_after_an_evaluation_forward)[0]
    # the last block (9 parameters) keeps its gathered copies after forward
    assert out["message"] == (
        "this optimizer holds FSDP2's unsharded copies of 9 parameters (a forward ran before it "
        "was built and no backward followed), so it would step tensors FSDP2 discards; build the "
        "optimizer before the first forward, or call forge_fsdp_wrap.reshard(model) before "
        "building it"
    )
    assert out["unchanged"]  # refused before anything was updated


def _optimizer_after_reshard() -> dict:
    model = _sharded()
    model(torch.randint(0, CFG.vocab_size, (2, 8))).sum()
    before = _shard_values(model)  # reshard(model), as the message advises
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    message = _one_step(model, optimizer)
    after = _shard_values(model)
    return {
        "shards": all(isinstance(p, DTensor) for p in held),
        "message": message,
        "all_moved": len(after) == len(held) and not any(map(torch.equal, before, after)),
    }


def test_reshard_before_building_the_optimizer_gives_it_the_shards_and_they_train(run_on_ranks):
    for out in run_on_ranks(2, _optimizer_after_reshard):
        assert out == {"shards": True, "message": "stepped", "all_moved": True}


def _optimizer_built_inside_unshard() -> tuple[str, int]:
    model = _sharded()
    with unshard_fsdp2_model(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _one_step(model, optimizer), len(list(model.parameters()))


def test_an_optimizer_built_inside_unshard_fsdp2_model_is_stopped(run_on_ranks):
    message, params = run_on_ranks(2, _optimizer_built_inside_unshard)[0]
    assert message.startswith(f"{LINE} {params} parameters")  # every unit was gathered


class _WithFrozenPart(nn.Module):
    """A decoder and a frozen component (FSDP2 leaves it replicated: shard_frozen=False)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(1, 1, bias=False)
        self.decoder = Transformer(CFG)
        declare_components(self, {"scale": "scale", "decoder": "decoder"})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens) * self.scale(torch.ones(1, 1))


def _frozen_part_is_not_a_copy() -> dict:
    with torch.device("meta"):
        model = _WithFrozenPart()
    model.scale.requires_grad_(False)
    mesh = build_device_mesh({}, "cpu")
    apply_fsdp2(model, mesh, default_mp_policy(torch.float32), shard_frozen=False)
    model.to_empty(device="cpu")
    model.decoder.init_weights(seed=0)
    torch.nn.init.ones_(model.scale.weight)
    # NOTE: every parameter, the frozen one included (AdamW skips it: no gradient)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, CFG.vocab_size, (2, 8))).sum()  # an evaluation after building it
    marked = [n for n, p in model.named_parameters() if getattr(p, COPY_MARK, False)]
    return {"marked": marked, "message": _one_step(model, optimizer)}


def test_a_replicated_frozen_component_is_never_taken_for_a_copy(run_on_ranks):
    out = run_on_ranks(2, _frozen_part_is_not_a_copy)[0]
    assert out["marked"] and all(n.startswith("decoder.layers.1.") for n in out["marked"])
    assert (
        out["message"] == "stepped"
    )  # the optimizer built first holds shards and the frozen weight
