"""planner/data/feature-ab.json: published A/Bs of one recipe field, test data beside the planner's prediction."""

import json

import pytest

from planner.api import as_case
from planner.validation import FEATURE_AB, ab_arm_case, feature_ab


def test_every_ab_states_its_source_and_its_two_arms_and_each_arm_is_a_valid_case():
    data = json.loads(FEATURE_AB.read_text())
    assert data["ab"]
    for ab in data["ab"]:
        assert ab["source"] and ab["assumed"] and ab["label"]
        (off, off_measured), (on, on_measured) = ab["arms"]
        assert off != on and off_measured > 0 and on_measured > 0
        assert ab["field"] not in ab["case"]["training"]  # the arms alone set it
        for value in (off, on):
            assert getattr(as_case(ab_arm_case(ab, value)).training, ab["field"]) == value


def test_the_planner_predicts_each_arm_and_the_gain_is_the_ratio_of_their_steps():
    rows = feature_ab()
    data = json.loads(FEATURE_AB.read_text())["ab"]
    assert [r.name for r in rows] == [ab["name"] for ab in data]
    for r, ab in zip(rows, data, strict=True):
        (_, off_measured), (_, on_measured) = ab["arms"]
        assert r.measured_gain == pytest.approx(on_measured / off_measured - 1)
        off_s, on_s = r.predicted_s
        assert r.predicted_gain == off_s / on_s - 1
        # the expert all-to-all overlap hides communication: the arm with it is faster, measured and predicted
        if r.field == "ep_comm_overlap":
            assert on_s < off_s and r.measured_gain > 0
