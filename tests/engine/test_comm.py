"""comm.py on real ranks: the gloo gaps it handles, and what each span records."""

import pytest

pytestmark = pytest.mark.multiprocess


def test_uneven_all_to_all_flat_reduce_scatter_and_spans(pools):
    world = 2
    results = pools(world).run("tests.engine.pool_tasks:comm_gaps")
    for rank, r in enumerate(results):
        # from each sender s, the rows s sent to this rank: indices [rank*(s+1), (rank+1)*(s+1))
        expect = [[s, i] for s in range(world) for i in range(rank * (s + 1), (rank + 1) * (s + 1))]
        assert r["received"] == expect
        full = [float(x) for x in range(world * 6)]
        assert r["shard"] == [world * x for x in full[rank * 6:(rank + 1) * 6]]  # the sum over 2 ranks
        assert r["total"] == [float(world)] * 4
        names = [(name, is_async) for name, _, is_async in r["spans"]]
        assert names == [("all_to_all", False), ("reduce_scatter", False), ("all_reduce", True)]
        sent = {name: b for name, b, _ in r["spans"]}
        assert sent["all_to_all"] == (rank + 1) * 2 * 4  # rows to the other rank x 2 floats x 4 bytes
        assert sent["reduce_scatter"] == (world - 1) * world * 6 * 4 // world  # ring: (n-1)/n of the input
        assert sent["all_reduce"] == 2 * (world - 1) * 4 * 4 // world
