"""forge-cp's tests composed with forge-fsdp-wrap: apply_context_parallel keeps its place in the
stage order (refused after forge_fsdp_wrap's apply_ac, and twice; TP refused after it) and refuses
the models it cannot run."""

from __future__ import annotations

from tests.integration.cp.jobs import order_and_refusals


def test_cp_keeps_its_place_in_the_order_and_refuses_what_it_cannot_run(run_on_ranks):
    said = run_on_ranks(2, order_and_refusals)[0]
    assert "cannot apply 'cp' after ['ac']" in said["after_ac"]
    assert "TP -> CP -> EP" in said["after_ac"]
    assert "stage 'cp' was already applied" in said["twice"]
    assert "cannot apply 'tp' after ['cp']" in said["tp_after"]
    assert "Sequential has no attention module forge-cp can run" in said["no_attention"]
    assert "set parallelism.cp=1" in said["no_attention"]
    assert said["hugging_face"].startswith("parallelism.cp=2 with a Hugging Face 'qwen2' model")
