"""forge_domain: spatial domain parallelism for models whose activations are 2-D fields.

The ``domain`` mesh axis splits the height of every ``[..., H, W]`` activation into equal slabs;
each rank computes its slab, exchanging halo rows with its neighbours, so the result equals the
unsplit model (on the field padded to a multiple of the domain size).

- :func:`apply_domain_parallel` converts Conv2d, GroupNorm and height-covering LayerNorm in
  place and refuses layers that mix height positions otherwise (by name)
- :func:`shard_spatial` / :func:`unshard_spatial` / :func:`unpad_shard_interp`: fields to slabs
  and back (padding recorded and removed; no interpolation)
- :func:`sync_domain_gradients`: the domain group's gradient average (FSDP2/DDP do the data
  axes)
- :class:`FieldConfig` (``[field]``), ``FIELD_PRESETS``: the field model's config
- :func:`halo_exchange`, :func:`all_reduce_sum`: the differentiable collectives underneath

Behaviour follows CREDIT's design, with the statistics of its GroupNorm combined by a
differentiable all-reduce (CREDIT's plain all_reduce gives wrong input gradients). Depends on
forge_core and torch.
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

from .config import FIELD_PRESETS, FieldConfig

# NOTE: the layers are imported on first use, so that the config loads without torch.
_EXPORTS = {
    "all_reduce_sum": "comm",
    "halo_exchange": "comm",
    "REFUSED": "layers",
    "DomainConv2d": "layers",
    "DomainGroupNorm": "layers",
    "DomainLayerNorm": "layers",
    "WidthCircularConv2d": "layers",
    "apply_domain_parallel": "layers",
    "domain_group": "layers",
    "FieldBlock": "model",
    "FieldNet": "model",
    "SpatialShard": "spatial",
    "shard_spatial": "spatial",
    "sync_domain_gradients": "spatial",
    "unpad_shard_interp": "spatial",
    "unshard_spatial": "spatial",
}

if TYPE_CHECKING:
    from .comm import all_reduce_sum, halo_exchange
    from .layers import (
        REFUSED,
        DomainConv2d,
        DomainGroupNorm,
        DomainLayerNorm,
        WidthCircularConv2d,
        apply_domain_parallel,
        domain_group,
    )
    from .model import FieldBlock, FieldNet
    from .spatial import (
        SpatialShard,
        shard_spatial,
        sync_domain_gradients,
        unpad_shard_interp,
        unshard_spatial,
    )

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "FIELD_PRESETS",
    "REFUSED",
    "DomainConv2d",
    "DomainGroupNorm",
    "DomainLayerNorm",
    "FieldBlock",
    "FieldConfig",
    "FieldNet",
    "SpatialShard",
    "WidthCircularConv2d",
    "all_reduce_sum",
    "apply_domain_parallel",
    "domain_group",
    "halo_exchange",
    "shard_spatial",
    "sync_domain_gradients",
    "unpad_shard_interp",
    "unshard_spatial",
]
