"""Every invalid configuration gets a ForgeConfigError naming the field, the value and the fix:
forge_core's ParallelismConfig and ModelConfig (forge's ``load_config`` of whole configs:
tests/integration/core/test_load_config.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from forge_core import ForgeConfigError, ModelConfig, ParallelismConfig


def test_forge_config_error_is_a_value_error():
    assert issubclass(ForgeConfigError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"dp_shard": 0},
            r"parallelism\.dp_shard=0 is invalid: it must be a positive integer or -1",
        ),
        (
            {"dp_replicate": -1},
            r"parallelism\.dp_replicate=-1 is invalid: it must be a positive integer",
        ),
        ({"tp": 2.0}, r"parallelism\.tp=2\.0 must be an integer"),
        ({"cp": True}, r"parallelism\.cp=True must be an integer"),
        ({"ep": 0}, r"parallelism\.ep=0"),
        ({"pp": -2}, r"parallelism\.pp=-2"),
        ({"domain": "2"}, r"parallelism\.domain='2'"),
        (
            {"data": "fsdp"},
            r"parallelism\.data='fsdp' is invalid: choose one of \['fsdp2', 'ddp', 'none'\] \(did you mean 'fsdp2'\?\)",
        ),
        (
            {"dp_replicate": 2, "data": "none"},
            r"dp_replicate=2 needs data='fsdp2' \(HSDP\) or 'ddp'",
        ),
        (
            {"dp_shard": 4, "data": "ddp"},
            r"dp_shard=4 with data='ddp'.*set dp_replicate=4 and dp_shard=1",
        ),
    ],
)
def test_invalid_parallelism_fields_are_named(kwargs, pattern):
    with pytest.raises(ForgeConfigError, match=pattern):
        ParallelismConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "world", "pattern"),
    [
        ({"tp": 3}, 8, r"world size 8 is not divisible by .*tp=3.* = 3"),
        (
            {"dp_shard": 2, "tp": 2},
            8,
            r"dp_shard=2 = 4 ranks, but the world size is 8; set dp_shard=-1",
        ),
        ({"data": "none"}, 4, r"data='none' but 4 of the 4 ranks are left for data parallelism"),
        ({"ep": 3}, 4, r"parallelism\.ep=3 must divide dp_shard=4.*choose ep in \[1, 2, 4\]"),
        ({"ep": 4, "tp": 2}, 4, r"parallelism\.ep=4 must divide dp_shard=2"),
        ({"ep": 2, "dp_replicate": 2, "data": "ddp"}, 2, r"ep=2 needs data='fsdp2'"),
    ],
)
def test_layouts_that_do_not_fit_the_world_size_are_refused(kwargs, world, pattern):
    with pytest.raises(ForgeConfigError, match=pattern):
        ParallelismConfig(**kwargs).resolve(world)


def test_resolve_infers_dp_shard_and_ddp_degree():
    assert ParallelismConfig(tp=2).resolve(8).dp_shard == 4
    assert ParallelismConfig(dp_replicate=2).resolve(8).dp_shard == 4
    ddp = ParallelismConfig(data="ddp").resolve(4)
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.dp_degree) == (4, 1, 4)
    assert ParallelismConfig(data="none", tp=4).resolve(4).dp_degree == 1
    # ep is carved out of the DP ranks: it does not multiply the world size
    assert ParallelismConfig(ep=4).resolve(4).world_size == 4


def test_credit_style_dict_and_mixed_keys():
    cfg = ParallelismConfig.from_any({"data": "ddp", "tensor": 2, "domain": 2})
    assert (cfg.data, cfg.tp, cfg.domain) == ("ddp", 2, 2)
    with pytest.raises(ForgeConfigError, match=r"mixes CREDIT-style key 'tensor' with \['tp'\]"):
        ParallelismConfig.from_any({"tensor": 2, "tp": 2})
    with pytest.raises(
        ForgeConfigError, match=r"unknown parallelism key 'dp_shards' \(did you mean 'dp_shard'\?\)"
    ):
        ParallelismConfig.from_any({"dp_shards": 2})


def test_validation_happens_before_any_process_group():
    with pytest.raises(ForgeConfigError):
        ParallelismConfig(tp=3).resolve(8)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"dim": 60, "n_heads": 8}, r"model\.dim=60 is not divisible by model\.n_heads=8"),
        ({"n_kv_heads": 3}, r"model\.n_kv_heads=3 must be a positive divisor of model\.n_heads=4"),
        ({"n_layers": 0}, r"model\.n_layers=0 must be a positive integer"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 4}, r"head dim dim/n_heads=3 must be even"),
    ],
)
def test_invalid_model_configs(kwargs, pattern):
    base = {"vocab_size": 32, "dim": 64, "n_layers": 2, "n_heads": 4}
    with pytest.raises(ForgeConfigError, match=pattern):
        ModelConfig(**{**base, **kwargs})


def test_model_presets_and_defaults():
    cfg = ModelConfig(vocab_size=32, dim=96, n_layers=1, n_heads=4)
    assert cfg.n_kv_heads == 4 and cfg.ffn_dim == 256  # 8/3 * 96 = 256, a multiple of 64
    assert ModelConfig.preset("debug", n_layers=3).n_layers == 3
    with pytest.raises(
        ForgeConfigError, match=r"unknown model preset 'debgu' \(did you mean 'debug'\?\)"
    ):
        ModelConfig.preset("debgu")
    with pytest.raises(
        ForgeConfigError, match=r"unknown model field 'n_layer' \(did you mean 'n_layers'\?\)"
    ):
        ModelConfig.preset("debug", n_layer=3)


def test_ep_minus_one_picks_the_largest_degree_dividing_dp_shard_and_the_experts():
    assert ParallelismConfig(ep=-1).resolve(4, num_experts=8).ep == 4
    assert ParallelismConfig(ep=-1, tp=2).resolve(8, num_experts=6).ep == 2
    assert ParallelismConfig(ep=-1).resolve(4, num_experts=0).ep == 1  # dense model
    assert ParallelismConfig(ep=-1, data="ddp").resolve(4, num_experts=8).ep == 1


#: 2**40: more than any size, count or rank degree forge takes.
HUGE = 2**40


def test_the_python_api_refuses_non_finite_model_numbers():
    base = {"vocab_size": 32, "dim": 64, "n_layers": 2, "n_heads": 4}
    with pytest.raises(ForgeConfigError, match=r"model\.norm_eps=nan"):
        ModelConfig(**base, norm_eps=float("nan"))
    with pytest.raises(ForgeConfigError, match=r"model\.rope_theta=-inf"):
        ModelConfig(**base, rope_theta=float("-inf"))
    assert ModelConfig(**base, rope_theta=500000.0, norm_eps=1e-6).rope_theta == 500000.0


def test_a_world_size_beyond_any_machine_is_refused_at_once():
    """Resolving 2**40 ranks once listed the divisors of 2**40 for the ep message: a hang."""
    with pytest.raises(ForgeConfigError, match=r"^world_size=1099511627776 is too large"):
        ParallelismConfig(ep=3).resolve(HUGE)
