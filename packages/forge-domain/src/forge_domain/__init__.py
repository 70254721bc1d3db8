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
- :func:`halo_exchange`, :func:`all_reduce_sum`: the differentiable collectives underneath

Behaviour follows CREDIT's design, with the statistics of its GroupNorm combined by a
differentiable all-reduce (CREDIT's plain all_reduce gives wrong input gradients). Depends on
forge_core and torch.
"""

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

__all__ = [
    "REFUSED",
    "DomainConv2d",
    "DomainGroupNorm",
    "DomainLayerNorm",
    "FieldBlock",
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
