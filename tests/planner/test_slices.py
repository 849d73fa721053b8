"""TPU multislice (cluster.slices, planner.costs.tpu_slices): a job's chips split into equal slices joined over
the data-center network, each slice's torus from its own chip count; and which groups go round a torus
axis (hardware.collectives: only one spanning the whole slice axis)."""

import pytest

from hardware.chips import get_chip
from hardware.collectives import Hierarchy, Torus
from planner.case import Cluster, SpecError, parse_case
from planner.costs import case_chip, cluster_chip, topology, tpu_slices


def _case(chip="tpu-v4", num_chips=6144, tp=12, **cluster):
    return {"model": {"layers": 4, "hidden": 6144, "heads": 48, "kv_heads": 48, "ffn": 24576, "vocab": 32000,
                      "seq_len": 2048},
            "training": {"global_batch": num_chips // tp * 2, "micro_batch": 1},
            "parallel": {"dp": num_chips // tp, "tp": tp, "pp": 1, "cp": 1},
            "cluster": {"chip": chip, "num_chips": num_chips, **cluster}}


def test_a_job_larger_than_the_largest_slice_runs_on_the_fewest_equal_slices():
    v4, v5e = get_chip("tpu-v4"), get_chip("tpu-v5e")  # pods of 16x16x16 and 16x16
    assert tpu_slices(v4, 4096) == 1 and tpu_slices(v4, 6144) == 2 and tpu_slices(v5e, 8192) == 32
    # PaLM's 6144 chips: two pods' 3072, a 12x16x16 slice each
    assert cluster_chip(v4, 6144, 4).torus_shape == (12, 16, 16)
    # stated, the slices may be smaller than they need to be
    assert cluster_chip(v4, 6144, 4, None, 3).torus_shape == (8, 16, 16)
    assert case_chip(Cluster("tpu-v5p", 512, 4, None, 2)).torus_shape == (4, 8, 8)
    assert case_chip(Cluster("tpu-v5p", 512, 4)).torus_shape == (8, 8, 8)


def test_the_model_parallel_ring_wraps_round_its_slice_axis_and_the_data_parallel_group_crosses_dcn():
    chip = cluster_chip(get_chip("tpu-v4"), 6144, 4)
    tp = topology(chip, 12, 1, 4)
    assert isinstance(tp, Torus) and [(a.size, a.wraparound) for a in tp.axes] == [(12, True)]
    dp = topology(chip, 512, 12, 4)
    assert isinstance(dp, Hierarchy) and dp.domain_size == 256 and "DCN" in dp.describe()


def test_twelve_chips_of_a_sixteen_long_axis_are_a_line():
    # the same model-parallel group on one 4096-chip pod: 12 of its 16 chips, no wraparound for them
    pod = cluster_chip(get_chip("tpu-v4"), 4096, 4)
    assert [(a.size, a.wraparound) for a in topology(pod, 12, 1, 4).axes] == [(12, False)]


@pytest.mark.parametrize("cluster,words", [
    ({"chip": "h100", "num_chips": 64, "tp": 8, "slices": 2}, "TPU multislice only"),
    ({"chip": "tpu-v5p", "num_chips": 512, "tp": 8, "slices": 3}, "must divide num_chips=512"),
    ({"chip": "tpu-v5e", "num_chips": 512, "tp": 8, "slices": 1}, "inside TPU v5e's largest, 16x16"),
    ({"chip": "tpu-v5p", "num_chips": 6000, "tp": 8, "slices": 2}, "slice shape"),  # 3000: no TPU shape
    ({"chip": "tpu-v5e", "num_chips": 512, "tp": 8, "slices": 0}, "cluster.slices"),
])
def test_a_bad_slice_count_names_the_field(cluster, words):
    with pytest.raises(SpecError, match="cluster.slices") as err:
        parse_case(_case(cluster.pop("chip"), cluster.pop("num_chips"), cluster.pop("tp"), **cluster))
    assert words in str(err.value)


def test_only_a_slice_of_whole_cubes_wraps_round_a_3d_torus():
    # [SB] Part 2: the optical switches that close a v4 / v5p axis join whole 4x4x4 cubes, so a 2x2x4 slice
    # has no wraparound; a v5e 8x16 wraps its 16 axis
    v5p, v5e = get_chip("tpu-v5p"), get_chip("tpu-v5e")
    assert cluster_chip(v5p, 16, 4).torus_shape == (2, 2, 4)
    assert [a.wraparound for a in topology(cluster_chip(v5p, 16, 4), 16, 1, 4).axes] == [False, False, False]
    assert [a.wraparound for a in topology(cluster_chip(v5p, 64, 4), 64, 1, 4).axes] == [True, True, True]
    small = cluster_chip(v5e, 128, 4)
    assert sorted(small.torus_shape) == [8, 16]
    wraps = {a.size: a.wraparound for a in topology(small, 128, 1, 4).axes}
    assert wraps == {8: False, 16: True}


def test_a_group_that_does_not_tile_the_slice_takes_whole_axes_first():
    # 16 ranks 3 apart on v5p's 16x16x24: a whole 16-long axis, which wraps, not 16 chips of the 24-long one
    from hardware.collectives import group_topology

    own = group_topology(get_chip("tpu-v5p"), 16, stride=3)
    assert [(a.size, a.wraparound) for a in own.axes] == [(16, True)]


def test_a_job_whose_chips_have_no_slice_shape_splits_into_slices_that_do():
    # 37 chips make no TPU slice (nothing to factor into a torus), so 37 one-chip slices over DCN; 3000 v5p
    # chips (no shape with axes that are multiples of 4) are 75 slices of 40 (2x2x10)
    from planner.costs import slice_shape

    v5p = get_chip("tpu-v5p")
    assert slice_shape(v5p, 37) is None and tpu_slices(v5p, 37) == 37
    assert slice_shape(v5p, 3000) is None and tpu_slices(v5p, 3000) == 75
    assert cluster_chip(v5p, 3000, 4).torus_shape == (2, 2, 10)
