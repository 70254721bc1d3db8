"""The multi-rank harness reports failures and hangs clearly, and the parity check can fail."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from forge_core.testing import StepRecord, compare_runs
from forge_core.testing.harness import RankError


def _rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return dist.get_rank()


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins


def test_run_returns_results_in_rank_order_and_collectives_work(run_on_ranks):
    assert run_on_ranks(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)]


def test_a_rank_traceback_appears_in_the_failure(run_on_ranks):
    with pytest.raises(RankError) as info:
        run_on_ranks(2, _fail_on_rank_one)
    msg = str(info.value)
    assert (
        "--- rank 1 ---" in msg
        and "ValueError: boom on rank one" in msg
        and "_fail_on_rank_one" in msg
    )
    assert run_on_ranks(2, _rank_and_sum)[0] == (0, 3.0)  # pool still usable


def test_a_hang_times_out_with_a_message_and_the_pool_restarts(run_on_ranks):
    # NOTE: the session's pool of 2 (no pool of its own to start and stop); started first, so
    # the 2 s below time the task alone (rank 1 answers at once; rank 0 never does).
    assert run_on_ranks(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)]
    with pytest.raises(RankError, match=r"ranks \[0\]: no answer within 2s.*pool restarted"):
        run_on_ranks(2, _hang_on_rank_zero, timeout=2)
    assert run_on_ranks(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)]


def _turn_onednn_off() -> bool:
    torch.backends.mkldnn.enabled = False
    return True


def _onednn_enabled() -> bool:
    return bool(torch.backends.mkldnn.enabled)


def test_a_job_that_turns_onednn_off_leaves_it_on_for_the_next_job(run_on_ranks):
    """Float8 jobs on CPU turn oneDNN off (forge_float8.use_torch_cpu_fp8_kernels); a later job
    in the same reused rank process must not inherit it, success or failure."""
    assert run_on_ranks(2, _onednn_enabled) == [True, True]
    assert run_on_ranks(2, _turn_onednn_off) == [True, True]
    assert run_on_ranks(2, _onednn_enabled) == [True, True]


def _gpus_seen() -> tuple[str | None, bool]:
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


def test_cpu_ranks_never_see_a_gpu_and_the_caller_keeps_its_environment(run_on_ranks):
    # Found on the first GPU run: an import in the forkserver (torchao asks the device's
    # capability) initialized CUDA there, and every rank forked from it failed to import
    # torchao or transformers ("Cannot re-initialize CUDA in forked subprocess").
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert run_on_ranks(2, _gpus_seen) == [("", False)] * 2
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


def test_start_cpu_forkserver_restores_the_callers_variables(monkeypatch):
    from forge_core.testing.harness import PRELOAD, start_cpu_forkserver

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.delenv("FORGE_TEST_EXTRA", raising=False)
    start_cpu_forkserver(PRELOAD, {"FORGE_TEST_EXTRA": "1"})  # already running: no new server
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and "FORGE_TEST_EXTRA" not in os.environ


def test_workers_are_separate_processes(run_on_ranks):
    assert run_on_ranks(2, os.getpid) != [os.getpid()] * 2


def test_parity_check_fails_beyond_tolerance_and_names_the_step():
    ref = [StepRecord(2.0, 1.0), StepRecord(1.5, 1.0)]
    ok = compare_runs(ref, [StepRecord(2.0 * (1 + 5e-6), 1.0), StepRecord(1.5, 1.0 + 5e-5)])
    assert ok.passed
    ok.assert_ok()
    first_step_off = compare_runs(ref, [StepRecord(2.0 * (1 + 2e-5), 1.0), StepRecord(1.5, 1.0)])
    assert not first_step_off.passed
    grad_off = compare_runs(ref, [StepRecord(2.0, 1.0), StepRecord(1.5, 1.0 + 2e-4)])
    assert not grad_off.passed
    with pytest.raises(AssertionError, match="FAIL"):
        grad_off.assert_ok()
