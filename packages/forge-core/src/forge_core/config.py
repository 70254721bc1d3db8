"""The parallelism layout every layer shares: :class:`ParallelismConfig` (``[parallelism]``).

``ParallelismConfig`` describes how ranks are laid out (mesh axes and the data-parallel mode);
:meth:`ParallelismConfig.resolve` infers the degrees left open for a world size. Pure Python on
integers (no torch import): it runs before any process group exists, so a bad layout fails fast
with a message that names the field, the value and the fix.

A whole job's config (every layer's section) is composed by the ``forge`` package
(``forge.load_config``), not here: forge_core imports no other forge package.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import MAX_RANKS, ForgeConfigError, check_field_types, check_int, did_you_mean

__all__ = ["DATA_MODES", "ParallelismConfig"]

DATA_MODES = ("fsdp2", "ddp", "none")
_AXIS_FIELDS = ("dp_replicate", "dp_shard", "cp", "tp", "ep", "pp", "domain")

#: NOTE: MAX_RANKS says why: no machine has more ranks, and resolve() lists divisors of these.
_RANKS_WHY = "2**20, more ranks than any machine has"


def _check_positive_int(name: str, value: Any, *, allow_infer: bool = False) -> None:
    ok = (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (value >= 1 or (allow_infer and value == -1))
    )
    if not ok:
        allowed = (
            "a positive integer or -1 (infer from the world size)"
            if allow_infer
            else "a positive integer"
        )
        raise ForgeConfigError(f"parallelism.{name}={value!r} is invalid: it must be {allowed}")
    check_int(f"parallelism.{name}", value, -1, MAX_RANKS, why=_RANKS_WHY)


@dataclass(frozen=True)
class ParallelismConfig:
    """How the ranks are laid out.

    Axes (outermost first in the mesh): ``pp, dp_replicate, dp_shard, cp, domain, tp``; world size
    = their product. ``ep`` is not a factor of the world size: expert parallelism is carved out of
    the ``dp_shard`` ranks (``dp_shard = dp_shard_mod_ep x ep``; with cp > 1 out of
    ``dp_shard x cp``), so EP peers work on different
    tokens and no dense compute is duplicated; it needs ``data='fsdp2'``. Tensor-parallel peers
    run the MoE layers replicated (same tokens), each in its own EP group.
    ``dp_shard=-1`` infers the degree from the world size; ``ep=-1`` picks the largest degree
    that divides both ``dp_shard`` and the model's ``num_experts`` (1 for a dense model).

    ``expert_tp``: with tp > 1, each MoE expert's hidden units are split over the tp ranks
    (instead of every tp rank keeping every expert whole), with or without ep.

    ``data`` picks the data-parallel mode: ``fsdp2`` shards over ``dp_shard`` (and replicates over
    ``dp_replicate``: HSDP), ``ddp`` replicates over ``dp_replicate`` (``dp_shard`` must be 1; -1
    resolves to 1 and the inferred degree goes to ``dp_replicate``), ``none`` has no DP axis.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    domain: int = 1
    data: str = "fsdp2"
    expert_tp: bool = False

    def __post_init__(self) -> None:
        check_field_types(self, "parallelism")
        for name in _AXIS_FIELDS:
            _check_positive_int(name, getattr(self, name), allow_infer=name in ("dp_shard", "ep"))
        if self.data not in DATA_MODES:
            raise ForgeConfigError(
                f"parallelism.data={self.data!r} is invalid: choose one of {list(DATA_MODES)}"
                + did_you_mean(str(self.data), DATA_MODES)
            )
        if self.dp_replicate > 1 and self.data == "none":
            raise ForgeConfigError(
                f"parallelism.dp_replicate={self.dp_replicate} needs data='fsdp2' (HSDP) or 'ddp'; "
                "data='none' has no data parallelism"
            )
        if self.data == "ddp" and self.dp_shard > 1:
            raise ForgeConfigError(
                f"parallelism.dp_shard={self.dp_shard} with data='ddp': DDP replicates, it does not "
                f"shard; set dp_replicate={self.dp_shard} and dp_shard=1 (or data='fsdp2')"
            )

    @classmethod
    def from_any(cls, obj: ParallelismConfig | Mapping[str, Any]) -> ParallelismConfig:
        """Accept a ``ParallelismConfig``, a dict of its fields, or CREDIT's ``{data, tensor, domain}``."""
        if isinstance(obj, ParallelismConfig):
            return obj
        if not isinstance(obj, Mapping):
            raise ForgeConfigError(
                f"parallelism must be a ParallelismConfig or a dict, got {type(obj).__name__}"
            )
        credit_keys = {"tensor"}
        if credit_keys & obj.keys():
            unknown = set(obj) - {"data", "tensor", "domain"}
            if unknown:
                raise ForgeConfigError(
                    f"parallelism mixes CREDIT-style key 'tensor' with {sorted(unknown)}; use either "
                    "{data, tensor, domain} or ParallelismConfig field names (tp instead of tensor)"
                )
            try:
                cfg = cls(
                    data=obj.get("data", "fsdp2"), tp=obj["tensor"], domain=obj.get("domain", 1)
                )
            except ForgeConfigError as err:  # NOTE: in the user's words: their key is 'tensor'
                raise ForgeConfigError(
                    str(err).replace("parallelism.tp=", "parallelism.tensor=")
                ) from None
            object.__setattr__(cfg, "_credit", True)  # NOTE: not a field: resolve() reads it
            return cfg
        names = {f.name for f in fields(cls)}
        for key in obj:
            if key not in names:
                raise ForgeConfigError(
                    f"unknown parallelism key '{key}'{did_you_mean(key, names)}; valid keys: {sorted(names)}"
                )
        return cls(**obj)

    @property
    def world_size(self) -> int:
        """Product of the axes; only meaningful once resolved (``dp_shard != -1``)."""
        return math.prod(getattr(self, n) for n in _AXIS_FIELDS if n != "ep")

    @property
    def dp_degree(self) -> int:
        """Number of data-parallel ranks (replicate x shard) of a resolved config."""
        return self.dp_replicate * self.dp_shard

    def resolve(self, world_size: int, num_experts: int = 0) -> ParallelismConfig:
        """Infer ``dp_shard`` (and ``ep=-1`` from ``num_experts``, 0 = dense model) and check
        every product against ``world_size``."""
        check_int("world_size", world_size, 1, MAX_RANKS, why=_RANKS_WHY)
        fixed = self.dp_replicate * self.cp * self.tp * self.pp * self.domain
        # NOTE: a CREDIT-style dict ({data, tensor, domain}) hears about its own key names.
        tp = "tensor" if getattr(self, "_credit", False) else "tp"
        parts = f"dp_replicate={self.dp_replicate} x cp={self.cp} x {tp}={self.tp} x pp={self.pp} x domain={self.domain}"
        if self.dp_shard == -1:
            if world_size % fixed:
                raise ForgeConfigError(
                    f"world size {world_size} is not divisible by {parts} = {fixed}; choose degrees "
                    f"whose product divides {world_size}"
                )
            inferred = world_size // fixed
            if self.data == "ddp":
                resolved = replace(self, dp_shard=1, dp_replicate=self.dp_replicate * inferred)
            else:
                resolved = replace(self, dp_shard=inferred)
        else:
            resolved = self
            if fixed * self.dp_shard != world_size:
                raise ForgeConfigError(
                    f"{parts} x dp_shard={self.dp_shard} = {fixed * self.dp_shard} ranks, but the world "
                    f"size is {world_size}; set dp_shard=-1 to infer it, or change the degrees"
                )
        if resolved.data == "none" and resolved.dp_degree > 1:
            raise ForgeConfigError(
                f"data='none' but {resolved.dp_degree} of the {world_size} ranks are left for data "
                f"parallelism; set data='fsdp2' or 'ddp', or raise {tp}/cp/domain to use them"
            )
        if resolved.ep == -1:
            experts_split = resolved.data == "fsdp2" and num_experts > 0
            auto = math.gcd(resolved.dp_shard, num_experts) if experts_split else 1
            resolved = replace(resolved, ep=max(auto, 1))
        if resolved.ep > 1 and resolved.data != "fsdp2":
            raise ForgeConfigError(
                f"parallelism.ep={resolved.ep} needs data='fsdp2' (EP is carved out of the dp_shard "
                f"ranks); got data={resolved.data!r}"
            )
        # NOTE: with cp > 1 EP is carved out of dp_shard x cp (forge_mesh): cp ranks hold other
        # tokens too.
        pool, pool_text = resolved.dp_shard * resolved.cp, f"dp_shard={resolved.dp_shard}"
        if resolved.cp > 1:
            pool_text += f" x cp={resolved.cp}"
        if resolved.ep > 1 and pool % resolved.ep:
            raise ForgeConfigError(
                f"parallelism.ep={resolved.ep} must divide {pool_text}: expert "
                f"parallelism is carved out of those ranks; choose ep in "
                f"{[d for d in range(1, pool + 1) if pool % d == 0]}"
            )
        return resolved
