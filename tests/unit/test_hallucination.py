"""CHAIR / POPE counting (stages/evaluate/hallucination.py) on hand-computed values: the one
implementation the vlm gates and GIFT share."""

from __future__ import annotations

import math

import pytest

from stages.evaluate import hallucination as metrics
from stages.tasks import shapes

# --- CHAIR and POPE ------------------------------------------------------------------------------

VOCAB = ["red circle", "blue square", "green triangle", "yellow cross"]


def test_chair_counts_mentions_and_hallucinations_by_hand():
    captions = ["A red circle and a blue square.",
                "Two red circles and a green triangle.",  # plural; green triangle is not there
                "Some yellow crosses, and a circle.",  # plural -es; a bare shape names nothing
                "A bred circle."]  # whole words only: no mention
    objects = [["red circle", "blue square"], ["red circle", "red circle"], ["blue square"], []]
    records = metrics.chair_per_image(captions, objects, VOCAB)
    assert [(r["mentioned"], r["hallucinated"], r["chair_sentence"]) for r in records] == [
        (2, 0, 0.0), (2, 1, 1.0), (1, 1, 1.0), (0, 0, 0.0)]
    assert records[1]["hallucinated_objects"] == ["green triangle"]
    assert metrics.chair(records) == {"chair_sentence": 0.5, "chair_instance": 0.4}  # 2/4 captions, 2/5 mentions
    assert metrics.chair(records, [1, 1]) == {"chair_sentence": 1.0, "chair_instance": 0.5}
    # correct mentions 2 + 1 + 0 + 0 = 3 of 5 mentioned; present classes 2 + 1 + 1 + 0 = 4
    assert metrics.objects_f1(records) == pytest.approx(
        {"precision": 0.6, "recall": 0.75, "f1": 2 * 3 / 9})
    with pytest.raises(ValueError, match="purple star"):
        metrics.chair_per_image(["x"], [["purple star"]], VOCAB)


def test_pope_counts_by_hand():
    answers = ["Yes, there is.", "no", "Yes", "I think so", "No."]
    labels = [True, True, False, False, False]
    result = metrics.pope(metrics.pope_per_item(answers, labels))
    # tp 1, predicted yes 2, labelled yes 2; correct: 1st, 4th (unparsed = not yes), 5th
    assert result == pytest.approx({"accuracy": 0.6, "precision": 0.5, "recall": 0.5, "f1": 0.5,
                                    "yes_ratio": 0.4, "unparsed": 0.2})
    # a model that never says yes: F1 is 0 where some answer is yes (no true positive), not
    # undefined; precision is undefined (no yes answer); all undefined without any yes at all
    never = metrics.pope(metrics.pope_per_item(["no", "no", "no"], [True, False, False]))
    assert never["f1"] == 0.0 and never["recall"] == 0.0 and math.isnan(never["precision"])
    none = metrics.pope(metrics.pope_per_item(["no", "no"], [False, False]))
    assert math.isnan(none["f1"]) and none["accuracy"] == 1.0


def test_paired_bootstrap_resamples_the_same_images_on_both_sides():
    base = metrics.chair_per_image(["a red circle"] * 10, [["blue square"]] * 10, VOCAB)
    same = metrics.paired_bootstrap(lambda r, i: metrics.chair(r, i)["chair_sentence"], base, base)
    assert same == (0.0, 0.0, 0.0)
    fixed = metrics.chair_per_image(["a blue square"] * 10, [["blue square"]] * 10, VOCAB)
    drop = metrics.paired_bootstrap(lambda r, i: metrics.chair(r, i)["chair_sentence"], fixed, base,
                                    relative=True, draws=200)
    assert drop == (-1.0, -1.0, -1.0)


def test_shapes_class_names_are_the_exact_vocabulary():
    vocab = shapes.class_names({"red", "blue"}, {"circle", "square"})
    assert vocab == ["blue circle", "blue square", "red circle", "red square"]
    records = metrics.chair_per_image(["a red circle and a blue triangle", "a circle"],
                                      [["red circle"], ["blue square"]], vocab)
    # "blue triangle" is not a class of this vocabulary; a bare shape names nothing
    assert [(r["mentioned"], r["hallucinated"], r["missed"]) for r in records] == [
        (1, 0, 0), (0, 0, 1)]
    assert math.isclose(metrics.objects_f1(records)["recall"], 0.5)


def test_paired_ratio_bootstrap_by_hand():
    # CHAIR_I as a ratio of sums: method 1/4 hallucinated mentions, baseline 2/4
    num_m, den_m = [0, 1, 0, 0], [1, 1, 1, 1]
    num_b, den_b = [1, 1, 0, 0], [1, 1, 1, 1]
    diff, low, high, per_pair = metrics.paired_ratio_bootstrap(num_m, den_m, num_b, den_b,
                                                               draws=500)
    assert diff == pytest.approx(-0.25) and low <= diff <= high
    assert per_pair == pytest.approx([-1.0, 0.0, 0.0, 0.0])       # mean = the difference
    rel = metrics.paired_ratio_bootstrap(num_m, den_m, num_b, den_b, relative=True, draws=500)
    assert rel[0] == pytest.approx(-0.5)                           # -0.25 / 0.5
    same = metrics.paired_ratio_bootstrap(num_b, den_b, num_b, den_b, draws=200)
    assert same[:3] == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="equally long"):
        metrics.paired_ratio_bootstrap([1], [1], [1, 2], [1, 1])


def test_gates_seeds_per_family_and_repeated_seeds_refused():
    from stages.evaluate.vlm_gates import Config

    cfg = Config(seeds=[0, 1, 2], shapes_seeds=[0, 1, 2, 3, 4])
    assert cfg.family_seeds("shapes") == [0, 1, 2, 3, 4] and cfg.family_seeds("text") == [0, 1, 2]
    assert Config(seeds=[0, 1]).family_seeds("shapes") == [0, 1]
    with pytest.raises(ValueError, match="repeat a seed"):
        Config(shapes_seeds=[0, 1, 1])
    with pytest.raises(ValueError, match="repeat a seed"):
        Config(seeds=[2, 2])
