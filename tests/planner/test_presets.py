"""Presets: every model preset estimates on a cluster preset; TPU slices get their torus shapes."""

import pytest

from hardware.chips import get_chip
from planner.api import estimate
from planner.costs import tpu_slice_shape
from planner.models import DEFAULT_MODEL, MODEL_PRESETS, SpecError
from planner.presets import CLUSTER_PRESETS, DEFAULT_CLUSTER, make_case


def test_defaults_exist():
    assert DEFAULT_MODEL in MODEL_PRESETS and DEFAULT_CLUSTER in CLUSTER_PRESETS


@pytest.mark.parametrize("model", ["Llama 3 8B", "Gemma 7B", "Llama 2 13B"])
def test_small_models_fit_one_h100_node(model):
    est = estimate(make_case(model, "8x H100 (one node)"))
    assert est.fits and 0.1 < est.mfu < 0.8


def test_llama3_405b_does_not_fit_one_node_and_says_so():
    est = estimate(make_case("Llama 3 405B", "8x H100 (one node)"))
    assert not est.fits and est.memory.total_bytes > 80e9
    # the least-memory layout is reported: everything sharded and recomputed
    assert est.layout.recompute == "full"


def test_mixtral_uses_expert_parallelism_when_free():
    est = estimate(make_case("Mixtral 8x7B", "1,024x H100 (128 nodes)"))
    assert est.fits and est.layout.ep > 1


@pytest.mark.parametrize("chips, shape", [(64, (4, 4, 4)), (512, (8, 8, 8)), (1024, (8, 8, 16)),
                                          (4096, (16, 16, 16)), (6144, (16, 16, 24))])
def test_tpu_v5p_slice_shapes(chips, shape):
    assert tpu_slice_shape(get_chip("tpu-v5p"), chips) == shape


def test_make_case_names_bad_fields():
    with pytest.raises(SpecError, match="training.recompte"):
        make_case("Llama 3 8B", "8x H100 (one node)", recompte="full")
    with pytest.raises(SpecError, match="model"):
        make_case("Llama 9", "8x H100 (one node)")
