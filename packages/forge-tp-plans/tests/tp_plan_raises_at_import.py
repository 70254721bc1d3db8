"""A plan module that fails when imported (tests/integration/test_plan_checks.py)."""

raise RuntimeError("this module does something at import")
