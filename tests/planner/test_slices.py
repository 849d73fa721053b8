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
    ({"chip": "tpu-v5e", "num_chips": 512, "tp": 8, "slices": 1}, "at most 256 chips"),
    ({"chip": "tpu-v5e", "num_chips": 512, "tp": 8, "slices": 0}, "cluster.slices"),
])
def test_a_bad_slice_count_names_the_field(cluster, words):
    with pytest.raises(SpecError, match="cluster.slices") as err:
        parse_case(_case(cluster.pop("chip"), cluster.pop("num_chips"), cluster.pop("tp"), **cluster))
    assert words in str(err.value)
