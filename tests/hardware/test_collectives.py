"""Alpha-beta collective costs against the scaling book's worked examples and hand-worked cases.

[SB] = "How to Scale Your Model" (jax-ml scaling book). Links with latency 0 isolate the bandwidth
term so it can be compared with the book's bandwidth-only numbers exactly.
"""

import math
from dataclasses import replace

import pytest

from hardware.chips import get_chip
from hardware.collectives import (
    Hierarchy,
    Link,
    Ring,
    Switch,
    Torus,
    deduplicated_all_to_all_s,
    group_topology,
    hierarchy,
    ring,
    switch,
    torus,
)

US = 1e-6
MS = 1e-3


def test_sb_h100_all_gather_65_us():
    # [SB] Part 12: AllGather of bf16[1024, 16384] over 8 H100s at 450 GB/s ~ 65 us.
    # V = 1024 * 16384 * 2 = 33,554,432 B; (8-1)/8 * V / 450e9 = 29,360,128 / 450e9 = 65.2 us.
    v = 1024 * 16384 * 2
    assert switch(8, Link(450e9, 0.0)).all_gather_s(v) == pytest.approx(65.245 * US, rel=1e-4)
    assert ring(8, Link(450e9, 0.0)).all_gather_s(v) == pytest.approx(65.245 * US, rel=1e-4)
    # The H100 table entry adds 7 NCCL ring steps of its measured latency (1.5 us): 75.7 us.
    h100 = group_topology(get_chip("h100"), 8)
    assert isinstance(h100, Switch)
    assert h100.all_gather_s(v) == pytest.approx(65.245 * US + 7 * get_chip("h100").scaleup_latency_s, rel=1e-4)


def test_sb_v5p_compute_over_ici():
    # [SB] Part 3: C / W_ici = 4.59e14 / 1.8e11 = 2550, W_ici bidirectional = 2 x one-way link.
    v5p = get_chip("tpu-v5p")
    assert v5p.bf16_flops_per_s / (2 * v5p.scaleup_bytes_per_s) == pytest.approx(2550)


def _slice(chip, shape):
    """The chip as a job on a slice of `shape` sees it (planner.costs.cluster_chip does the same)."""
    return replace(chip, torus_shape=shape, scaleup_domain=math.prod(shape))


def test_sb_v4p_4x4x4_all_gathers():
    # [SB] Part 3, Question 2: TPU v4p 4x4x4, bf16[B_X, D_Y], B=1024, D=4096, W_bidi = 9e10.
    # AllGather_X moves the gathered 2BD/Y = 2,097,152 B over one wrapped axis of 4:
    # [SB] 2BD / (9e10 * Y) = 23.3 us, which drops the (n-1)/n = 3/4 factor we keep: 17.5 us.
    link = Link(4.5e10, 0.0)
    v = 2 * 1024 * 4096 / 4
    assert torus((4,), link).all_gather_s(v) == pytest.approx(3 / 4 * v / 9e10)
    assert torus((4,), link).all_gather_s(v) * 4 / 3 == pytest.approx(23.3e-6, rel=2e-3)
    # AllGather_XY of the whole 2BD over two axes: [SB] 2BD / (2 * 9e10) = 46.6 us (x 15/16 here).
    assert torus((4, 4), link).all_gather_s(4 * v) * 16 / 15 == pytest.approx(46.6e-6, rel=2e-3)
    # On the chip table: the 4x4x4 slice's axis of 4 wraps around (a multiple of 4), plus 2 hops of 1 us.
    v4_group = group_topology(_slice(get_chip("tpu-v4"), (4, 4, 4)), 4)
    assert v4_group.all_gather_s(v) == pytest.approx(3 / 4 * v / 9e10 + 2 * US)


def test_sb_v4p_latency_bound_all_gather():
    # [SB] Part 3, Question 3: AllGather_X of bf16[128] (256 B) on a wrapped axis of 4: 2 hops, ~2 us.
    assert torus((4,), Link(4.5e10, US)).all_gather_s(256) == pytest.approx(2 * US, rel=1e-2)


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    # Rabenseifner's all-reduce (Thakur et al. 2005): AR = RS + AG, so 2x an all-gather on every topology
    # (bandwidth terms; with latency, rings too).
    link = Link(100e9, 2 * US)
    ideal = Link(100e9, 0.0)
    topologies = [ring(8, link), switch(8, ideal), torus((4, 4), link), torus((8,), link, wraparound=False),
                  hierarchy(32, 8, ideal, Link(10e9, 0.0))]
    for topo in topologies:
        v = 3e8
        assert topo.reduce_scatter_s(v) == pytest.approx(topo.all_gather_s(v))
        assert topo.all_reduce_s(v) == pytest.approx(2 * topo.all_gather_s(v))


def test_large_all_reduce_groups_pay_tree_latency():
    # Across nodes, NCCL's double binary tree: 2 log2(n) latency steps instead of the ring's 2 (n-1), same
    # bandwidth; inside a node the ring.
    link = Link(50e9, 5 * US)
    assert switch(8, link, trees=True).all_reduce_s(0.0) == pytest.approx(6 * 5 * US)  # 2 log2 8 = 6 < 14
    assert switch(1024, link, trees=True).all_reduce_s(0.0) == pytest.approx(20 * 5 * US)
    assert switch(2, link, trees=True).all_reduce_s(0.0) == pytest.approx(2 * 5 * US)
    assert switch(8, link).all_reduce_s(0.0) == pytest.approx(14 * 5 * US)
    v = 1e9
    assert switch(1024, link, trees=True).all_reduce_s(v) == pytest.approx(20 * 5 * US + 2 * 1023 / 1024 * v / 50e9)
    assert group_topology(get_chip("h100"), 64, stride=8).trees


def test_fill_adds_one_pipeline_fill_per_collective():
    # A measured curve's slow ramp: latency + fill + bus bytes / bandwidth, once per operation.
    link = Link(100e9, US, fill_s=160 * US)
    v = 8e8
    assert switch(8, link).all_gather_s(v) == pytest.approx(7 * US + 160 * US + 7 / 8 * v / 100e9)
    assert switch(8, link).all_reduce_s(v) == pytest.approx(14 * US + 160 * US + 2 * 7 / 8 * v / 100e9)
    assert switch(1, link).all_gather_s(v) == 0.0


def test_a_mesh_gives_a_group_one_link_per_peer():
    # MI300X: 7 Infinity Fabric links of 64 GB/s; a pair uses one of them, the 8 GPUs all seven.
    mi = get_chip("mi300x")
    pair, node = group_topology(mi, 2), group_topology(mi, 8)
    assert pair.link.bytes_per_s == pytest.approx(448e9 / 7)
    assert node.link.bytes_per_s == pytest.approx(448e9)
    h100 = get_chip("h100")
    assert group_topology(h100, 2).link.bytes_per_s == group_topology(h100, 8).link.bytes_per_s


def test_ring_all_gather_hand_worked():
    # n=4, V=4e9 B, W=1e10 B/s, alpha=1 us: 3 steps of 1e9 B -> 3 * (1e9/1e10 + 1e-6) = 300.003 ms.
    assert ring(4, Link(1e10, US)).all_gather_s(4e9) == pytest.approx(300.003 * MS)


def test_ring_all_to_all_hand_worked():
    # n=4, each rank holds b=4e6 B as four 1e6 B chunks sent 1, 2, 3 hops ahead: 6e6 link-bytes per
    # rank, 4 ranks over 4 links -> 6e6 B per link / 1e9 B/s = 6 ms; plus 3 hops of latency.
    assert ring(4, Link(1e9, 0.0)).all_to_all_s(4e6) == pytest.approx(6 * MS)
    assert ring(4, Link(1e9, US)).all_to_all_s(4e6) == pytest.approx(6 * MS + 3 * US)


@pytest.mark.parametrize("n", [4, 8, 16])
def test_bidirectional_ring_all_to_all_is_quarter_of_v_over_w_bidi(n):
    # [SB] Part 3: all-to-all on a bidirectional ring costs V / (4 W_bidi), V = n * b the whole array.
    # Hand check n=8, b=8e6: chunks 1e6 B go min(d, 8-d) = 1,2,3,4,3,2,1 hops = 16e6 link-bytes per rank,
    # 8 ranks over 16 directed links = 8e6 B per link / 1e9 = 8 ms = 64e6 / (4 * 2e9).
    w = 1e9
    b = 8e6
    assert torus((n,), Link(w, 0.0)).all_to_all_s(b) == pytest.approx(n * b / (4 * 2 * w))


def test_switch_all_to_all_sends_what_leaves_each_rank():
    # [SB] Part 12: on NVSwitch each GPU sends (n-1)/n of its b bytes through its own port.
    # n=8, b=8e8, W=4e11: 7e8 / 4e11 = 1.75 ms, plus one alpha.
    assert switch(8, Link(4e11, US)).all_to_all_s(8e8) == pytest.approx(1.75 * MS + US)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_torus_wraparound_halves_the_ring(n):
    # [SB] Part 3: a bidirectional ring with wraparound moves data both ways: V / W_bidi = half the
    # unidirectional ring; without wraparound the end chips have one neighbour and it is the ring again.
    link = Link(4.5e10, 0.0)
    v = 1e9
    assert torus((n,), link).all_gather_s(v) == pytest.approx(ring(n, link).all_gather_s(v) / 2)
    assert torus((n,), link, wraparound=False).all_gather_s(v) == pytest.approx(ring(n, link).all_gather_s(v))


def test_torus_latency_hops():
    # Bidirectional ring of 16: farthest rank ceil(15/2) = 8 hops; a line of 16: 15 hops.
    link = Link(1e30, US)
    assert torus((16,), link).all_gather_s(1.0) == pytest.approx(8 * US)
    assert torus((16,), link, wraparound=False).all_gather_s(1.0) == pytest.approx(15 * US)
    assert torus((4, 4), link).all_gather_s(1.0) == pytest.approx(4 * US)


def test_torus_more_axes_more_bandwidth():
    # [SB] Part 3: AllGather over k axes is k times faster: (n-1)/n * V / (k * W_bidi).
    # 4x4 torus, V=1.6e9, W=1e10 one-way: 15/16 * 1.6e9 / (2 * 2e10) = 37.5 ms.
    link = Link(1e10, 0.0)
    assert torus((4, 4), link).all_gather_s(1.6e9) == pytest.approx(37.5 * MS)
    t3 = torus((4, 4, 4), link).all_gather_s(6.4e9)
    assert t3 == pytest.approx(63 / 64 * 6.4e9 / (3 * 2e10))


def test_sb_v5e_4x4_gather_without_wraparound():
    # [SB] Part 2, problem 6: gathering 16 GB on a v5e 4x4 (no wraparound below 16) along 2 axes at
    # 4.5e10 B/s per link: 15e9 / (4.5e10 * 2) = 167 ms.
    topo = torus((4, 4), Link(4.5e10, 0.0), wraparound=False)
    assert topo.all_gather_s(16e9) == pytest.approx(15e9 / 9e10)


def test_hierarchy_reduces_to_a_switch_inside_one_domain():
    inner, outer = Link(450e9, US), Link(50e9, 5 * US)
    for n in (1, 2, 8):
        h = hierarchy(n, 8, inner, outer)
        flat = switch(n, inner)
        for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"):
            assert h.cost_s(op, 1e8) == pytest.approx(flat.cost_s(op, 1e8))


def test_hierarchy_hand_worked():
    # 16 ranks = 2 nodes x 8, NVLink 450 GB/s, network 50 GB/s per GPU, V = 1.6e9 B.
    # AG across nodes on V/8 = 2e8: 1/2 * 2e8 / 50e9 = 2 ms; inside on V: 7/8 * 1.6e9 / 450e9 = 3.111 ms.
    # [SB] Part 12: the levels overlap, T = max(T_node, T_network) = 3.111 ms (NVLink-bound here).
    # AR: max(2 * 3.111, 2 * 2) = 6.222 ms.
    h = hierarchy(16, 8, Link(450e9, 0.0), Link(50e9, 0.0))
    assert isinstance(h, Hierarchy)
    inside = 7 / 8 * 1.6e9 / 450e9
    assert h.all_gather_s(1.6e9) == pytest.approx(inside)
    assert h.all_reduce_s(1.6e9) == pytest.approx(2 * inside)
    # The flat ring over the network would move 15/16 of V twice at 50 GB/s: 60 ms.
    assert h.all_reduce_s(1.6e9) < ring(16, Link(50e9, 0.0)).all_reduce_s(1.6e9) / 5
    # 64 ranks = 8 nodes: across on 2e8 is 7/8 * 2e8 / 50e9 = 3.5 ms > 3.111: network-bound, which is
    # [SB]'s bytes / W_node_egress with W_node_egress = 8 x 50 GB/s, times (m-1)/m.
    h8 = hierarchy(64, 8, Link(450e9, 0.0), Link(50e9, 0.0))
    assert h8.all_gather_s(1.6e9) == pytest.approx(7 / 8 * 1.6e9 / 400e9)
    # All-to-all, b = 1.6e9 on 16 ranks: 8/16 leaves the node: 8e8 / 50e9 = 16 ms (inside: 7/16 at 450 GB/s).
    assert h.all_to_all_s(1.6e9) == pytest.approx(16 * MS)
    # Latencies add: 1 + 7 ring steps of 5 us and 1 us.
    hl = hierarchy(16, 8, Link(450e9, US), Link(50e9, 5 * US))
    assert hl.all_gather_s(0) == pytest.approx(5 * US + 7 * US)
    with pytest.raises(ValueError, match="multiple of the domain size"):
        hierarchy(12, 8, Link(1e9, 0), Link(1e9, 0))


def test_nccls_flat_rings_load_each_nic_with_n_minus_1_over_n_of_its_rail():
    # 64 ranks = 8 nodes x 8: hierarchically the network carries 7/8 of V/8 per NIC; NCCL's flat ring 63/64
    inner, outer = Switch(8, Link(450e9, 0.0)), Switch(8, Link(50e9, 0.0))
    hier = Hierarchy(64, 8, inner, outer)
    flat = Hierarchy(64, 8, inner, outer, flat=True)
    assert hier.all_gather_s(1.6e9) == pytest.approx(7 / 8 * 2e8 / 50e9)
    assert flat.all_gather_s(1.6e9) == pytest.approx(63 / 64 * 2e8 / 50e9)
    assert flat.all_reduce_s(1.6e9) == pytest.approx(2 * 63 / 64 * 2e8 / 50e9)


def test_a_flat_ring_pays_the_scale_up_latency_in_every_domain_it_passes():
    # 512 ranks = 64 nodes x 8, 1 us an NVLink step, 10 us a network step. NCCL's ring all-gather takes 511
    # steps, 63 of them between nodes (src/graph/tuning.cc: (nsteps - nInterSteps) intra + nInterSteps inter):
    # 448 us + 630 us; the hierarchical algorithm 7 + 630
    inner, outer = Switch(8, Link(450e9, US)), Switch(64, Link(50e9, 10 * US), trees=True)
    flat = Hierarchy(512, 8, inner, outer, flat=True)
    assert flat.all_gather_s(0) == pytest.approx(448 * US + 630 * US)
    assert flat.reduce_scatter_s(0) == pytest.approx(448 * US + 630 * US)
    assert Hierarchy(512, 8, inner, outer).all_gather_s(0) == pytest.approx(7 * US + 630 * US)
    # all-reduce: the ring's 2 x (448 + 630) us against the trees' 2 x (7 + log2(64) x 10) = 134 us: the trees
    assert flat.all_reduce_s(0) == pytest.approx(2 * 7 * US + 2 * 6 * 10 * US)
    # where the network runs no trees (its Switch's `trees` false) the ring through all 16: 2 x (14 + 1 x 10) us
    halves = Hierarchy(16, 8, inner, Switch(2, Link(50e9, 10 * US)), flat=True)
    assert halves.all_reduce_s(0) == pytest.approx(2 * 14 * US + 2 * 10 * US)
    # the bandwidth term is the flat ring's as before
    assert flat.all_gather_s(1.6e9) - flat.all_gather_s(0) == pytest.approx(511 / 512 * 1.6e9 / 8 / 50e9)


@pytest.mark.parametrize("chip, plateau", [("h100", 350e9), ("h200", 369e9), ("b200", 382e9)])
def test_four_node_all_reduce_reaches_the_measured_busbw(chip, plateau):
    # [NCCLT] 4 nodes x 8 GPUs, all_reduce busbw at 16 GiB: ~350 (H100, read off arXiv 2411.13055's figure),
    # 369.06 (H200), 381.8 (B200) GB/s ([MLE]); 8 % covers the fills fitted on other curves
    topo = group_topology(get_chip(chip), 32, 1, achievable=True)
    assert isinstance(topo, Hierarchy) and topo.flat
    nbytes = 16 * 2**30
    busbw = nbytes / topo.all_reduce_s(nbytes) * 2 * 31 / 32
    assert busbw == pytest.approx(plateau, rel=0.08)


def test_latency_dominates_tiny_messages():
    # 8 B all-reduce over 8 H100s: 2 * 7 ring steps of 1.5 us = 21 us; the bytes add < 0.1 ns.
    alpha = get_chip("h100").scaleup_latency_s
    topo = group_topology(get_chip("h100"), 8)
    assert topo.all_reduce_s(8) == pytest.approx(14 * alpha, rel=1e-4)
    # ... while a 1 GB all-reduce is bandwidth-bound: 2 * 7/8 * 1e9 / 450e9 = 3.89 ms >> 21 us.
    assert topo.all_reduce_s(1e9) == pytest.approx(2 * 7 / 8 * 1e9 / 450e9 + 14 * alpha)


def test_p2p_is_alpha_plus_bytes_over_bandwidth():
    # Hockney: 1e9 B over one 450 GB/s NVLink direction plus one step of latency: 2.2222 ms + 1.5 us.
    alpha = get_chip("h100").scaleup_latency_s
    assert group_topology(get_chip("h100"), 2).p2p_s(1e9) == pytest.approx(1e9 / 450e9 + alpha)
    assert ring(1, Link(1e9, US)).p2p_s(1e9) == 0.0
    assert torus((4,), Link(1e9, US)).p2p_s(1e6) == pytest.approx(1 * MS + US)


def test_single_rank_costs_nothing():
    for topo in (ring(1, Link(1e9, US)), switch(1, Link(1e9, US)), torus((1,), Link(1e9, US))):
        for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"):
            assert topo.cost_s(op, 1e9) == 0.0


def test_gpu_group_topology():
    h100 = get_chip("h100")
    tp = group_topology(h100, 8, stride=1)
    assert isinstance(tp, Switch) and tp.link.bytes_per_s == 450e9
    dp = group_topology(h100, 4, stride=8)  # one rank per node
    assert isinstance(dp, Switch) and dp.link.bytes_per_s == 50e9
    mixed = group_topology(h100, 16, stride=1)  # two full nodes
    assert isinstance(mixed, Hierarchy) and mixed.domain_size == 8
    spread = group_topology(h100, 4, stride=4)  # ranks 0, 4 | 8, 12: two per node
    assert isinstance(spread, Hierarchy) and spread.domain_size == 2
    nvl72 = group_topology(get_chip("gb200-nvl72"), 64)
    assert isinstance(nvl72, Switch) and nvl72.link.bytes_per_s == 900e9
    achievable = group_topology(h100, 8, achievable=True)
    assert achievable.link.bytes_per_s == pytest.approx(450e9 * h100.link_efficiency)
    assert "NVLink" in tp.describe() and "scale-out" in dp.describe()
    # A cluster with 4 GPUs per NVLink domain: the 8-GPU tp group now spans two domains.
    small = group_topology(h100, 8, scaleup_domain=4)
    assert isinstance(small, Hierarchy) and small.domain_size == 4
    with pytest.raises(ValueError, match="torus slice"):
        group_topology(get_chip("tpu-v4"), 8, scaleup_domain=8)


def test_tpu_group_topology():
    v5e, v5p = get_chip("tpu-v5e"), get_chip("tpu-v5p")
    full_axis = group_topology(v5e, 16)
    assert isinstance(full_axis, Torus) and [(a.size, a.wraparound) for a in full_axis.axes] == [(16, True)]
    # v5e wraps only a full 16 axis; v5p any slice axis that is a multiple of 4 ([SB] Part 2), and a group
    # wraps only where it spans the whole axis: 4 chips of a 16-long axis are a line, those of a 4x4x4 slice
    # a ring
    assert [a.wraparound for a in group_topology(v5e, 4).axes] == [False]
    assert [a.wraparound for a in group_topology(v5p, 4).axes] == [False]
    assert [a.wraparound for a in group_topology(_slice(v5p, (4, 4, 4)), 4).axes] == [True]
    assert [a.wraparound for a in group_topology(_slice(v5e, (4, 4)), 4).axes] == [False]
    pod = group_topology(v5e, 256)
    assert [a.size for a in pod.axes] == [16, 16]
    # A group stepping 4 chips along an axis shares its links with 3 interleaved groups.
    strided = group_topology(v5e, 4, stride=4)
    assert strided.axes[0].link.bytes_per_s == pytest.approx(4.5e10 / 4)
    # Beyond one pod: two pods joined over DCN.
    two_pods = group_topology(v5e, 512)
    assert isinstance(two_pods, Hierarchy) and two_pods.outer.link.bytes_per_s == v5e.scaleout_bytes_per_s
    across = group_topology(v5e, 2, stride=256)
    assert isinstance(across, Switch) and "DCN" in across.describe()
    # 64 ranks 16 apart on v5p's largest slice, 16x16x24: the whole second axis, wrapped, and 4 chips of the
    # 24-long third, a line
    own = group_topology(v5p, 64, stride=16)
    assert isinstance(own, Torus) and [(a.size, a.wraparound) for a in own.axes] == [(16, True), (4, False)]
    # 3 ranks 300 apart on v5e (a 256-chip pod): each in another pod.
    assert "DCN" in group_topology(v5e, 3, stride=300).describe()
    # 4,096 ranks 4,096 apart span 16.7M chips: not axes of one 6,144-chip slice (as they had been), DCN; 16
    # ranks 1,000 apart: 4 to a slice (6 fit, 4 divides 16), the slices joined over DCN
    assert "DCN" in group_topology(v5p, 4096, stride=4096).describe()
    spread = group_topology(v5p, 16, stride=1000)
    assert isinstance(spread, Hierarchy) and spread.domain_size == 4 and "DCN" in spread.outer.describe()
    # The same AllGather is twice as fast on a wrapped 16-ring as on a unidirectional ring of 16.
    link = Link(v5e.scaleup_bytes_per_s, v5e.scaleup_latency_s)
    assert full_axis.all_gather_s(1e9) < Ring(16, link).all_gather_s(1e9) / 1.9


def test_bad_arguments_are_clear():
    link = Link(1e9, 0.0)
    with pytest.raises(ValueError, match="whole number of ranks"):
        ring(0, link)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        ring(4, link).all_gather_s(-1)
    with pytest.raises(ValueError, match="positive number of bytes/s"):
        Link(0, 0)
    with pytest.raises(ValueError, match="unknown collective"):
        ring(4, link).cost_s("broadcast", 1)
    with pytest.raises(ValueError, match="stride"):
        group_topology(get_chip("h100"), 2, stride=0)
    with pytest.raises(ValueError, match="torus axes"):
        torus((), link)


def test_an_all_to_all_over_a_flat_group_is_not_a_ring():
    # an all-to-all posts its sends to every peer at once: one scale-up step of latency inside the domain
    # and the network's, however many domains (the flat ring's m x (d - 1) steps are for ring collectives)
    inner, outer = Switch(8, Link(450e9, US)), Switch(64, Link(50e9, 10 * US), trees=True)
    flat = Hierarchy(512, 8, inner, outer, flat=True)
    assert flat.all_to_all_s(0) == pytest.approx(US + 10 * US)
    assert deduplicated_all_to_all_s(flat, 0, 0) == pytest.approx(US + 10 * US)


def test_a_group_of_one_on_a_mesh_of_links_costs_nothing():
    """MI300X and MI355X join their GPUs by a full mesh: a group of one uses none of its links, whose share had come
    out as 0 bytes/s and stopped three lessons with a ValueError."""
    for key in ("mi300x", "mi355x"):
        assert group_topology(get_chip(key), 1).all_gather_s(1e6) == 0.0
