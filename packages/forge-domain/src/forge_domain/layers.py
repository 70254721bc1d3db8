"""Layers that compute on a height slab and equal the unsplit layer, and the conversion.

Activations are ``[..., H, W]`` (NCHW); the ``domain`` mesh axis splits ``H`` into equal slabs,
rank ``r`` holding rows ``[r * H_local, (r + 1) * H_local)``. Each converted layer is a subclass
of the original holding the same Parameter objects, so parameter names, state dicts and
optimizers are unchanged.

- :class:`DomainConv2d`: halo rows from the neighbours, then the convolution without height
  padding. For kernel ``k``, dilation ``d``, stride ``s`` and height padding ``p`` the rank needs
  ``p`` rows above and ``d (k - 1) - p - s + 1`` below (zero rows past the physical edge, as
  zero padding would give). The local output has ``H_local / s`` rows, which needs ``s`` to
  divide ``H_local`` and the layer to map ``H`` to ``H / s`` (checked, with the layer's name).
- :class:`WidthCircularConv2d`: a Conv2d that wraps around in width and pads height with zeros
  (a global latitude-longitude grid); its domain form wraps locally and exchanges halos.
- :class:`DomainGroupNorm` / :class:`DomainLayerNorm`: mean and variance over the whole field,
  summed over the slabs with a differentiable all-reduce (two passes: mean, then squared
  deviations, for accuracy). A LayerNorm over ``(..., H, W)`` uses its affine rows of the slab.
- Pointwise layers (activations, dropout, Linear over width, 1x1 work of any kind) are left as
  they are. Layers that mix positions along the height in ways not handled here are refused by
  name: pooling, upsampling, transposed convolutions, batch/instance norm, attention.
- Window attention: a module class declaring ``forge_domain_window_rows = n`` is allowed when
  its windows tile the slab (``n`` divides ``H_local``; checked at every forward).
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from forge_core.errors import ForgeConfigError
from forge_core.mesh_dims import sub_mesh
from forge_core.stages import stage
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from .comm import all_reduce_sum, halo_exchange

__all__ = [
    "DomainConv2d",
    "DomainGroupNorm",
    "DomainLayerNorm",
    "REFUSED",
    "WidthCircularConv2d",
    "apply_domain_parallel",
    "domain_group",
]

_M = TypeVar("_M", bound=nn.Module)

#: Layer classes that mix positions along the height and have no domain form here.
REFUSED: tuple[type[nn.Module], ...] = (
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.LPPool2d,
    nn.Upsample,
    nn.UpsamplingNearest2d,
    nn.UpsamplingBilinear2d,
    nn.ConvTranspose2d,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    nn.BatchNorm2d,
    nn.SyncBatchNorm,
    nn.InstanceNorm2d,
    nn.LocalResponseNorm,
    nn.MultiheadAttention,
    nn.Fold,
    nn.Unfold,
    nn.Conv1d,
    nn.Conv3d,
)


def domain_group(device_mesh: DeviceMesh) -> ProcessGroup:
    """The process group of the ``domain`` axis (``device_mesh`` may be that 1-D mesh)."""
    names = device_mesh.mesh_dim_names or ()
    if names == ("domain",):
        return device_mesh.get_group()
    if "domain" not in names:
        raise ForgeConfigError(
            f"the mesh has no 'domain' axis (axes {list(names)}); build it with "
            "parallelism.domain > 1"
        )
    return sub_mesh(device_mesh, "domain").get_group()


class WidthCircularConv2d(nn.Conv2d):
    """Conv2d padding the width circularly (wrap-around) and the height with zeros.

    ``padding`` is ``(p_h, p_w)`` as usual; ``padding_mode`` must stay ``zeros`` (the mixed
    padding is this class's own).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = self.padding
        if isinstance(padding, str):  # unpacking "same" / "valid" raised a ValueError here too
            raise ForgeConfigError(
                f"WidthCircularConv2d takes numeric padding (p_h, p_w), not padding={padding!r}"
            )
        p_h, p_w = padding
        x = F.pad(x, (p_w, p_w, 0, 0), mode="circular")
        x = F.pad(x, (0, 0, p_h, p_h))
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def _halo_sizes(conv: nn.Conv2d) -> tuple[int, int]:
    assert not isinstance(conv.padding, str)  # DomainConv2d.convert refuses string padding first
    k, d, s, p = conv.kernel_size[0], conv.dilation[0], conv.stride[0], conv.padding[0]
    return p, max(0, d * (k - 1) - p - s + 1)


class DomainConv2d(nn.Conv2d):
    """A Conv2d (or :class:`WidthCircularConv2d`) computing a height slab with halo exchange."""

    group: ProcessGroup
    domain_name: str
    circular_width: bool
    halo: tuple[int, int]
    # Narrower than Conv2d's ``str | tuple[int, ...]``: convert refuses string padding.
    padding: tuple[int, ...]

    @classmethod
    def convert(cls, conv: nn.Conv2d, group: ProcessGroup, name: str) -> DomainConv2d:
        if isinstance(conv.padding, str):
            raise ForgeConfigError(
                f"'{name}' ({type(conv).__name__}) uses padding={conv.padding!r}; give the "
                "padding as numbers for domain parallelism"
            )
        circular = isinstance(conv, WidthCircularConv2d)
        if conv.padding_mode != "zeros":
            raise ForgeConfigError(
                f"'{name}' uses padding_mode={conv.padding_mode!r}: domain parallelism supports "
                "zero padding, and wrap-around in width only (forge_domain.WidthCircularConv2d)"
            )
        return _adopt(
            cls,
            conv,
            group=group,
            domain_name=name,
            circular_width=circular,
            halo=_halo_sizes(conv),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stride[0]
        size = torch.distributed.get_world_size(self.group)
        H_local = x.shape[-2]
        unsplit_out = (
            H_local * size + 2 * self.padding[0] - self.dilation[0] * (self.kernel_size[0] - 1) - 1
        ) // s + 1
        if H_local % s or unsplit_out != H_local * size // s:
            raise ForgeConfigError(
                f"'{self.domain_name}' (kernel {self.kernel_size}, stride {self.stride}, padding "
                f"{self.padding}) maps height {H_local * size} to {unsplit_out} rows; a height slab "
                f"of {H_local} rows can only give {H_local // s} of them. Domain parallelism needs "
                "layers that map H to H / stride (e.g. padding = dilation * (kernel - 1) // 2) "
                "and slabs divisible by the stride"
            )
        top, bottom = self.halo
        if max(top, bottom) > H_local:
            raise ForgeConfigError(
                f"'{self.domain_name}' needs a halo of {max(top, bottom)} rows but the slab has "
                f"{H_local}; use fewer domain ranks or a larger field"
            )
        x = halo_exchange(x, top, bottom, self.group)
        p_w = self.padding[1]
        if self.circular_width:
            x = F.pad(x, (p_w, p_w, 0, 0), mode="circular")
            p_w = 0
        out = F.conv2d(x, self.weight, self.bias, self.stride, (0, p_w), self.dilation, self.groups)
        return out[..., : H_local // s, :]


def _adopt(cls: type[_M], module: nn.Module, **attrs: object) -> _M:
    """An instance of ``cls`` (a subclass of ``module``'s class) sharing ``module``'s
    Parameters, buffers, hooks and attributes, plus ``attrs``."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    new.__dict__.update(attrs)
    return new


def _normalize_over_field(
    x: torch.Tensor, dims: tuple[int, ...], eps: float, group: ProcessGroup
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and variance over ``dims`` of the whole field:
    slab sums combined by a differentiable all-reduce, in two passes (mean, then squared
    deviations) for accuracy."""
    count = torch.distributed.get_world_size(group)
    for d in dims:
        count *= x.shape[d]
    mean = all_reduce_sum(x.sum(dims, keepdim=True), group) / count
    centered = x - mean
    var = all_reduce_sum(centered.square().sum(dims, keepdim=True), group) / count
    return centered * torch.rsqrt(var + eps)


class DomainGroupNorm(nn.GroupNorm):
    """GroupNorm whose statistics cover the whole field, not the slab."""

    group: ProcessGroup

    @classmethod
    def convert(cls, norm: nn.GroupNorm, group: ProcessGroup) -> DomainGroupNorm:
        return _adopt(cls, norm, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C = x.shape[:2]
        xg = x.reshape(B, self.num_groups, -1)
        out = _normalize_over_field(xg, (-1,), self.eps, self.group).reshape(x.shape)
        if self.affine:
            shape = (1, C) + (1,) * (x.dim() - 2)
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


class DomainLayerNorm(nn.LayerNorm):
    """LayerNorm over trailing dims that include the height: whole-field statistics, and the
    affine parameters' rows of this slab."""

    group: ProcessGroup

    @classmethod
    def convert(cls, norm: nn.LayerNorm, group: ProcessGroup) -> DomainLayerNorm:
        return _adopt(cls, norm, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = torch.distributed.get_world_size(self.group)
        rank = torch.distributed.get_rank(self.group)
        n = len(self.normalized_shape)
        H_local, H = x.shape[-2], self.normalized_shape[-2]
        if H_local * size != H:
            raise ForgeConfigError(
                f"LayerNorm over {tuple(self.normalized_shape)} got height slabs of {H_local} "
                f"rows on {size} domain ranks (height {H_local * size}, expected {H})"
            )
        out = _normalize_over_field(x, tuple(range(-n, 0)), self.eps, self.group)
        if self.weight is not None:
            out = out * self.weight.narrow(-2, rank * H_local, H_local)
        if self.bias is not None:
            out = out + self.bias.narrow(-2, rank * H_local, H_local)
        return out


def _check_window(group: ProcessGroup, name: str, rows: int):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple) -> None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None and x.dim() >= 2 and x.shape[-2] % rows:
            raise ForgeConfigError(
                f"'{name}' attends within windows of {rows} rows, which do not tile a height "
                f"slab of {x.shape[-2]} rows; choose domain ranks and a height so that {rows} "
                "divides the slab"
            )

    return hook


def apply_domain_parallel(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Convert ``model``'s layers in place to compute height slabs over the ``domain`` axis.

    Conv2d (zeros padding, or :class:`WidthCircularConv2d`) -> :class:`DomainConv2d`; GroupNorm
    -> :class:`DomainGroupNorm`; LayerNorm over trailing dims that include the height ->
    :class:`DomainLayerNorm`; window attention declaring ``forge_domain_window_rows`` is checked
    at each forward; layers in :data:`REFUSED` raise ``ForgeConfigError`` naming them (nothing is
    converted then). Inputs must be height slabs (:func:`forge_domain.shard_spatial`) and
    replicated parameters need :func:`forge_domain.sync_domain_gradients` after backward.
    Order: after TP, EP and Float8, before AC, compile and FSDP2/DDP (enforced). Returns
    ``model``.
    """
    group = domain_group(device_mesh)
    refused = [
        f"'{name}' ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, REFUSED)
    ]
    if refused:
        raise ForgeConfigError(
            "domain parallelism cannot split these layers, which mix positions along the "
            f"height: {', '.join(refused)}. Remove them, move them outside the split part, or "
            "run with parallelism.domain=1"
        )
    convertible = (nn.Conv2d, nn.GroupNorm)
    if not any(
        isinstance(m, convertible) or (isinstance(m, nn.LayerNorm) and len(m.normalized_shape) > 1)
        for m in model.modules()
    ):
        raise ForgeConfigError(
            f"{type(model).__name__} has no Conv2d, GroupNorm or height-covering LayerNorm: "
            "nothing for domain parallelism to split (it is for models of 2-D fields); set "
            "parallelism.domain=1"
        )
    with stage(model, "domain"):
        for name, module in list(model.named_modules()):
            rows = getattr(type(module), "forge_domain_window_rows", None)
            if rows is not None:
                module.register_forward_pre_hook(_check_window(group, name, int(rows)))
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if name else None
            converted: nn.Module | None = None
            if isinstance(module, nn.Conv2d) and not isinstance(module, DomainConv2d):
                converted = DomainConv2d.convert(module, group, name)
            elif isinstance(module, nn.GroupNorm) and not isinstance(module, DomainGroupNorm):
                converted = DomainGroupNorm.convert(module, group)
            elif (
                isinstance(module, nn.LayerNorm)
                and not isinstance(module, DomainLayerNorm)
                and len(module.normalized_shape) >= 2
            ):
                converted = DomainLayerNorm.convert(module, group)
            if converted is not None:
                if parent is None:
                    raise ForgeConfigError(
                        "apply_domain_parallel converts layers inside a model; wrap this "
                        f"{type(module).__name__} in a module"
                    )
                parent.register_module(leaf, converted)
    return model
