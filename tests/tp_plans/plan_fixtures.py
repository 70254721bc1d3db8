"""Importable plans for the import-path tests (``tests.tp_plans.plan_fixtures:NAME``)."""

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

FFN_ONLY = {
    "layers.*.feed_forward.w1": ColwiseParallel(),
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": RowwiseParallel(),
}


def ffn_only_plan() -> dict:
    return dict(FFN_ONLY)


NOT_A_PLAN = ["layers.*.feed_forward.w1"]
