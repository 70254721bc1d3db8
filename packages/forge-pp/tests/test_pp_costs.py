"""forge-pp's cost terms: point to point per micro-batch with the neighbouring stages' ranks."""

from __future__ import annotations

from forge_core.costs import CollectiveTally
from forge_pp.costs import pp_collectives


def test_a_middle_rank_sends_and_receives_once_per_micro_batch_each_way():
    tally = CollectiveTally({"pp": 4})
    pp_collectives(tally, sends=1, recvs=1, passes=8, hidden_bytes=512)
    rows = {(c.phase, c.kind, c.what): (c.count, c.bytes) for c in tally.table()}
    assert rows[("forward", "send", "PP: activations to the next stage")] == (8, 512)
    assert rows[("forward", "recv", "PP: activations from the previous stage")] == (8, 512)
    assert rows[("backward", "send", "PP: their gradients back")] == (8, 512)
    assert rows[("backward", "recv", "PP: their gradients back")] == (8, 512)
    assert rows[("step", "all_reduce", "PP: grad norm of the other stages (fp64 scalar)")] == (1, 8)


def test_a_first_rank_only_sends():
    tally = CollectiveTally({"pp": 2})
    pp_collectives(tally, sends=1, recvs=0, passes=2, hidden_bytes=64)
    kinds = {(c.phase, c.kind) for c in tally.table() if c.group == "pp" and c.phase != "step"}
    assert kinds == {("forward", "send"), ("backward", "recv")}
