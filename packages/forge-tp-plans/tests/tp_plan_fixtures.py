"""Importable plans for the import-path tests (``tp_plan_fixtures:NAME``)."""

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

FFN_ONLY = {
    "layers.*.feed_forward.w1": ColwiseParallel(),
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": RowwiseParallel(),
}


def ffn_only_plan() -> dict:
    return dict(FFN_ONLY)


NOT_A_PLAN = ["layers.*.feed_forward.w1"]

# Wrong plans, each refused before launch (tests/integration/test_plan_checks.py).
A_NUMBER = 3


def returns_none(model, ctx):
    return None


def one_argument(model):
    return dict(FFN_ONLY)


def raises_inside(model, ctx):
    raise RuntimeError("the plan function broke")


UNKNOWN_STYLE = {"layers.*.feed_forward.w1": "colwize"}
MATCHES_NOTHING = {"layers.*.mlp.up_proj": "colwise"}
COLWISE_ON_A_NORM = {"layers.*.attention_norm": "colwise"}


def records_its_call():
    """A zero-argument plan function that leaves a mark when called: the launcher's check must
    import its module but never call it (tests/integration/test_plan_checks.py)."""
    import os
    from pathlib import Path

    Path(os.environ["FORGE_TEST_CALLED_MARK"]).write_text("called")
    return dict(FFN_ONLY)
