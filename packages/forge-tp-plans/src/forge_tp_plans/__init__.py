"""forge_tp_plans: tensor and sequence parallelism for the reference model, Hugging Face models,
and any model that opts in with class attributes.

- :func:`apply_tensor_parallel` chooses a plan (explicit > registered > Hugging Face > opt-in),
  validates it, shards with DTensor and records what it did (:func:`describe_tp_plan`)
- :func:`check_tensor_parallel` runs every check of that choice without a mesh (a launcher
  checks a plan on a meta-device model before any rank starts)
- :func:`translate_parallel_style` maps transformers 4.x / 5.x style strings to torch styles
- :func:`load_plan_object` imports the plan an import path names, calling nothing (a launcher's
  check before any rank starts)
- :func:`register_tp_plan` adds a plan for a model class
- :class:`TPConfig` (``[tp]``): plan import path, sequence/loss parallel choices
- :mod:`forge_tp_plans.checks`: the pure size and import-path checks (no torch import)
- ``ColwiseConv1x1`` / ``RowwiseConv1x1`` shard 1x1 convolutions on channels

The first stage of forge's order (TP -> CP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2). Depends on
forge_core and torch only.
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

# NOTE: imported on first use, so that the pure checks (forge_tp_plans.checks) load without torch.
_EXPORTS = {
    "AppliedPlan": "apply",
    "applied_tp_plan": "apply",
    "apply_tensor_parallel": "apply",
    "check_tensor_parallel": "apply",
    "describe_tp_plan": "apply",
    "check_plan_import": "checks",
    "check_transformer_tp": "checks",
    "TPConfig": "config",
    "PlanContext": "plans",
    "load_plan_object": "plans",
    "reference_plan": "plans",
    "register_tp_plan": "plans",
    "ColwiseConv1x1": "styles",
    "RowwiseConv1x1": "styles",
    "ReplicatedWithGradAllReduce": "styles",
    "PackedColwiseLinear": "styles",
    "PackedRowwiseLinear": "styles",
    "MlaKvAProjReplicated": "styles",
    "ColwiseConv1D": "fused_styles",
    "RowwiseConv1D": "fused_styles",
    "FusedQKVColwise": "fused_styles",
    "SplitAttentionHeads": "fused_styles",
    "tp_gradient_mismatches": "debug",
    "translate_parallel_style": "styles",
}

if TYPE_CHECKING:
    from .apply import (
        AppliedPlan,
        applied_tp_plan,
        apply_tensor_parallel,
        check_tensor_parallel,
        describe_tp_plan,
    )
    from .checks import check_plan_import, check_transformer_tp
    from .config import TPConfig
    from .debug import tp_gradient_mismatches
    from .fused_styles import ColwiseConv1D, FusedQKVColwise, RowwiseConv1D, SplitAttentionHeads
    from .plans import PlanContext, load_plan_object, reference_plan, register_tp_plan
    from .styles import (
        ColwiseConv1x1,
        MlaKvAProjReplicated,
        PackedColwiseLinear,
        PackedRowwiseLinear,
        ReplicatedWithGradAllReduce,
        RowwiseConv1x1,
        translate_parallel_style,
    )

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"
__all__ = [
    "AppliedPlan",
    "ColwiseConv1D",
    "ColwiseConv1x1",
    "FusedQKVColwise",
    "MlaKvAProjReplicated",
    "PackedColwiseLinear",
    "PackedRowwiseLinear",
    "RowwiseConv1D",
    "SplitAttentionHeads",
    "ReplicatedWithGradAllReduce",
    "tp_gradient_mismatches",
    "PlanContext",
    "RowwiseConv1x1",
    "TPConfig",
    "applied_tp_plan",
    "apply_tensor_parallel",
    "check_plan_import",
    "check_tensor_parallel",
    "check_transformer_tp",
    "describe_tp_plan",
    "load_plan_object",
    "reference_plan",
    "register_tp_plan",
    "translate_parallel_style",
]
