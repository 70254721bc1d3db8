"""forge_vlm's modules on one process: the placeholder merge, the adapter's pooling and the AC
scopes; the built VLM (from forge's ``debug_vlm`` config: init, freezing, the frozen-sharding
rule, the per-component stage contract, config refusals) is tested in
tests/integration/vlm/test_vlm_model.py."""

from __future__ import annotations

import pytest
import torch
from forge_core import ForgeConfigError
from forge_core.model import insert_embeddings
from forge_vlm import Adapter, AdapterConfig, ac_components


def test_insert_embeddings_puts_rows_in_order_at_the_masked_positions_with_gradients():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 5, generator=g, requires_grad=True)
    embeds = torch.randn(3, 2, 5, generator=g, requires_grad=True)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, [1, 2]] = mask[1, [0, 6]] = mask[2, [3, 5]] = True
    out = insert_embeddings(h, embeds, mask)
    expected = h.detach().clone()
    for b in range(3):
        for i, pos in enumerate(mask[b].nonzero().flatten().tolist()):
            expected[b, pos] = embeds[b, i]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.square().sum().backward()
    torch.testing.assert_close(embeds.grad, 2 * embeds.detach(), rtol=0, atol=0)
    assert (h.grad[mask] == 0).all() and (h.grad[~mask] != 0).all()


def test_insert_embeddings_refuses_a_mask_with_the_wrong_count():
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[:, :3] = True
    with pytest.raises(RuntimeError, match="exactly 2 positions per sample"):
        insert_embeddings(torch.zeros(2, 6, 4), torch.zeros(2, 2, 4), mask)
    with pytest.raises(ForgeConfigError, match="must be"):
        insert_embeddings(torch.zeros(2, 6, 4), torch.zeros(2, 2, 4), mask[:, :5])


def test_adapter_pools_patch_grid_neighbours_then_projects():
    adapter = Adapter(AdapterConfig(pool=2), in_dim=8, out_dim=12, grid=4)
    adapter.init_weights(0)
    x = torch.randn(1, 16, 8)
    out = adapter(x)
    assert out.shape == (1, 4, 12)
    grid = x.view(1, 4, 4, 8)
    top_left = grid[0, :2, :2].reshape(4, 8).mean(0)  # first pooled token: patches (0..1, 0..1)
    expected = adapter.fc2(torch.nn.functional.gelu(adapter.fc1(top_left)))
    torch.testing.assert_close(out[0, 0], expected)


def test_ac_scopes_map_to_components_and_skip_a_frozen_encoder():
    assert ac_components("all") == ("encoder", "decoder")
    assert ac_components("all", frozen_encoder=True) == ("decoder",)
    assert ac_components("language") == ("decoder",)
    with pytest.raises(ForgeConfigError, match="saves nothing"):
        ac_components("vision", frozen_encoder=True)
