"""reward=geneval: GenEval's scoring rules (yifan123/reward-server@92ac29f reward_server/gen_eval.py; the same code
in NVlabs/DiffusionNFT@24af555 flow_grpo/gen_eval.py) fed given detections through a stub detector and a stub
colour classifier (tests/helpers/reward_stubs.py). Every expectation is worked by hand from the reference's lines
(cited per test); the metadata rows are shaped as DiffusionNFT@24af555 dataset/geneval/test_metadata.jsonl's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.problems import ConfigError
from ddpo_tpu.rewards import make_reward
from ddpo_tpu.rewards.base import RewardError
from ddpo_tpu.rewards.geneval import (MAX_OBJECTS, TAGS, color_crops, compute_iou, evaluate, keep_detections,
                                      relative_position)
from tests.helpers import reward_stubs

DETECT, COLOURS = "tests.helpers.reward_stubs:detect", "tests.helpers.reward_stubs:colours"
H = W = 64


def box(x0, y0, x1, y1):
    return np.array([x0, y0, x1, y1], np.float64)


def image_with(*rects):
    """A #999-free image: black, with (x0, y0, x1, y1, rgb) rectangles painted in."""
    im = np.zeros((H, W, 3), np.uint8)
    for x0, y0, x1, y1, rgb in rects:
        im[y0:y1, x0:x1] = rgb
    return im


def score(rows, detections, images=None):
    """The reward's RewardScores for metadata rows and the detections the stub detector returns for them."""
    reward = make_reward("geneval", detector=DETECT, colors=COLOURS, lenient_accuracy=True)
    reward_stubs.DETECTIONS.clear()
    reward_stubs.DETECTIONS.extend(detections)
    images = np.stack(images) if images is not None else np.zeros((len(rows), H, W, 3), np.uint8)
    return reward.score(images, [r.get("prompt", "p") for r in rows], [
        {k: v for k, v in r.items() if k != "prompt"} for r in rows])


# -- pieces ---------------------------------------------------------------------------------------------------------


def test_relative_position_hand_worked():
    # gen_eval.py:119-136. A [0,0,10,10] vs B [20,0,30,10]: centres 5 and 25, offset (-20, 0), shrunk by 0.1*(10+10)
    # to (-18, 0), over |offset| 20: dx = -0.9 -> left of
    a, b = (box(0, 0, 10, 10), None), (box(20, 0, 30, 10), None)
    assert relative_position(a, b) == {"left of"} and relative_position(b, a) == {"right of"}
    # diagonal: offset (-20, -20) -> (-18, -18) / 28.28 = -0.636 on both axes -> left of and above
    assert relative_position(a, (box(20, 20, 30, 30), None)) == {"left of", "above"}
    # y grows downwards: B under A -> A is above B, B below A
    assert relative_position((box(0, 20, 10, 30), None), a) == {"below"}
    # offset (-1, 0) is inside 0.1*(10+10) = 2: shrunk to 0 -> no relation at all
    assert relative_position(a, (box(1, 0, 11, 10), None)) == set()
    # mostly horizontal: offset (-20, -5) -> (-18, -3) / 20.6 = (-0.87, -0.15): left of only
    assert relative_position(a, (box(20, 5, 30, 15), None)) == {"left of"}


def test_iou_counts_inclusive_pixels():
    # gen_eval.py:109-116: areas with +1; [0,0,9,9] and [5,0,14,9]: 10x10 each, overlap 5x10 -> 50 / 150
    assert compute_iou(box(0, 0, 9, 9), box(5, 0, 14, 9)) == pytest.approx(1 / 3)
    assert compute_iou(box(0, 0, 9, 9), box(20, 20, 29, 29)) == 0


def test_keep_detections_thresholds_order_and_cap():
    # gen_eval.py:275-289: > 0.3, > 0.9 for counting; sorted by score; at most 16; NMS 1.0 removes nothing (the same
    # box twice stays twice); a class left with none is absent
    same = box(0, 0, 10, 10)
    raw = {"cat": [(same, 0.5), (same, 0.95), (same, 0.3), (same, 0.91)], "dog": [(same, 0.2)]}
    kept = keep_detections(raw, "two_object")
    assert [o[0][4] for o in kept["cat"]] == [0.95, 0.91, 0.5] and "dog" not in kept
    assert [o[0][4] for o in keep_detections(raw, "counting")["cat"]] == [0.95, 0.91]
    many = {"cup": [(box(i, 0, i + 5, 5), 0.4 + i / 100) for i in range(20)]}
    kept = keep_detections(many, "single_object")["cup"]
    assert len(kept) == MAX_OBJECTS and kept[0][0][4] == pytest.approx(0.59)


def test_colour_crops_composite_the_mask_over_grey_then_crop_the_box():
    # gen_eval.py:64-85: a red square inside a blue box region; with its mask the crop is red on #999, without a
    # mask it is the image's own pixels (mostly blue)
    im = image_with((0, 0, 40, 40, (0, 0, 255)), (10, 10, 20, 20, (255, 0, 0)))
    mask = np.zeros((H, W), bool)
    mask[10:20, 10:20] = True
    masked, plain = color_crops(im, [(box(0, 0, 40, 40), mask), (box(0, 0, 40, 40), None)])
    assert masked.shape == plain.shape == (40, 40, 3)
    assert (masked[15, 15] == (255, 0, 0)).all() and (masked[2, 2] == (0x99, 0x99, 0x99)).all()
    assert reward_stubs.colour_of(masked) == "red" and reward_stubs.colour_of(plain) == "blue"


# -- the score and the strict accuracy, per tag ---------------------------------------------------------------------


def test_single_object():
    # gen_eval.py:219: one term 1 - |1 - found| / 1
    row = {"tag": "single_object", "include": [{"class": "bowl", "count": 1}], "prompt": "a photo of a bowl"}
    s = score([row, row, row], [{"bowl": [(box(0, 0, 9, 9), 0.8)]}, {"bowl": [(box(0, 0, 9, 9), 0.25)]},
                                {"cup": [(box(0, 0, 9, 9), 0.99)]}])
    np.testing.assert_array_equal(s.values, [1.0, 0.0, 0.0])  # 0.25 is under 0.3; a cup is not a bowl
    np.testing.assert_array_equal(s.extras["geneval/strict"], [1, 0, 0])


def test_two_object():
    row = {"tag": "two_object", "include": [{"class": "bowl", "count": 1}, {"class": "skis", "count": 1}]}
    s = score([row, row], [{"bowl": [(box(0, 0, 9, 9), 0.8)], "skis": [(box(20, 0, 29, 9), 0.7)]},
                           {"bowl": [(box(0, 0, 9, 9), 0.8)]}])
    np.testing.assert_array_equal(s.values, [1.0, 0.5])  # terms (1, 1) and (1, 0)
    np.testing.assert_array_equal(s.extras["geneval/strict"], [1, 0])


def test_counting_uses_the_higher_threshold_and_exact_counts():
    # gen_eval.py:275 (0.9 for counting), 219-222 (exact count for strict; the term can go negative)
    row = {"tag": "counting", "include": [{"class": "wine glass", "count": 2}],
           "exclude": [{"class": "wine glass", "count": 3}], "prompt": "a photo of two wine glasses"}
    glasses = lambda *scores: {"wine glass": [(box(10 * i, 0, 10 * i + 8, 8), p) for i, p in enumerate(scores)]}
    s = score([row] * 4, [glasses(0.95, 0.92, 0.5), glasses(0.95), glasses(0.99, 0.98, 0.97, 0.96, 0.95),
                          glasses(0.95, 0.94, 0.93)])
    # 2 kept (0.5 < 0.9): 1.0 strict; 1 of 2: 0.5; 5 of 2: 1 - 3/2 = -0.5; 3 of 2: 0.5 (strict ignores exclude)
    np.testing.assert_array_equal(s.values, [1.0, 0.5, -0.5, 0.5])
    np.testing.assert_array_equal(s.extras["geneval/strict"], [1, 0, 0, 0])
    # the benchmark's lenient rule (gen_eval.py:155-158, 194-198): >= 2 and fewer than 3 -> only the first passes
    np.testing.assert_array_equal(s.extras["geneval/accuracy"], [1, 0, 0, 0])


def test_colors_and_a_count_miss_with_a_colour_clause():
    # gen_eval.py:223-236: colour term 1 - |count - n_colour| / count; a count miss adds one 0.0 term instead
    row = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    red, blue = (0, 0, 20, 20, (255, 0, 0)), (0, 0, 20, 20, (0, 0, 255))
    car = {"car": [(box(0, 0, 20, 20), 0.9)]}
    s = score([row, row], [car, car], images=[image_with(red), image_with(blue)])
    np.testing.assert_array_equal(s.values, [1.0, 0.5])  # (1, 1) and (1, 0)
    np.testing.assert_array_equal(s.extras["geneval/strict"], [1, 0])
    two = {"tag": "colors", "include": [{"class": "car", "count": 2, "color": "red"}]}
    s = score([two], [car], images=[image_with(red)])
    assert s.values[0] == 0.25  # count term 1 - 1/2, then 0.0: mean 0.25


def test_color_attr_reads_each_object_through_its_mask():
    # DiffusionNFT's own example prompt; each object's colour from its masked crop (gen_eval.py:78-85, 226-236)
    row = {"tag": "color_attr", "include": [{"class": "handbag", "count": 1, "color": "red"},
                                            {"class": "scissors", "count": 1, "color": "white"}]}
    im = image_with((0, 0, 64, 64, (0, 0, 255)), (4, 4, 20, 20, (255, 0, 0)), (40, 40, 50, 50, (255, 255, 255)))
    m_bag, m_sc = np.zeros((H, W), bool), np.zeros((H, W), bool)
    m_bag[4:20, 4:20], m_sc[40:50, 40:50] = True, True
    dets = {"handbag": [(box(0, 0, 30, 30), 0.9, m_bag)], "scissors": [(box(30, 30, 64, 64), 0.8, m_sc)]}
    s = score([row], [dets], images=[im])
    assert s.values[0] == 1.0 and s.extras["geneval/strict"][0] == 1  # masks: red and white
    unmasked = {k: [(b, p, None) for b, p, _ in v] for k, v in dets.items()}  # the boxes are mostly blue
    s = score([row], [unmasked], images=[im])
    assert s.values[0] == 0.5 and s.extras["geneval/strict"][0] == 0  # terms (1, 0, 1, 0)


def test_position_including_the_references_extra_term_on_a_miss():
    # gen_eval.py:237-258: a held relation adds 1.0; a failed one adds 0.0 and then 1.0 (the append after the loop);
    # a missing target group adds 0.0
    row = {"tag": "position", "include": [{"class": "laptop", "count": 1},
                                          {"class": "cow", "count": 1, "position": ["right of", 0]}],
           "prompt": "a photo of a cow right of a laptop"}
    laptop, cow_right, cow_left = box(0, 0, 10, 10), box(30, 0, 40, 10), box(-30, 0, -20, 10)
    s = score([row] * 3, [{"laptop": [(laptop, 0.9)], "cow": [(cow_right, 0.9)]},
                          {"laptop": [(laptop, 0.9)], "cow": [(cow_left, 0.9)]},
                          {"cow": [(cow_right, 0.9)]}])
    # (1, 1, 1.0) -> 1; (1, 1, 0.0, 1.0) -> 3/4; (0, 1, 0.0) -> 1/3
    np.testing.assert_allclose(s.values, [1.0, 0.75, 1 / 3], rtol=1e-6)
    np.testing.assert_array_equal(s.extras["geneval/strict"], [1, 0, 0])
    np.testing.assert_array_equal(s.extras["geneval/accuracy"], [1, 0, 0])


def test_position_is_not_checked_after_a_colour_miss():
    # gen_eval.py:237 `and matched`: a colour miss stops the clause; no position term is added
    row = {"tag": "position", "include": [{"class": "laptop", "count": 1},
                                          {"class": "cow", "count": 1, "color": "red", "position": ["right of", 0]}]}
    im = image_with((30, 0, 40, 10, (0, 0, 255)))
    s = score([row], [{"laptop": [(box(0, 0, 10, 10), 0.9)], "cow": [(box(30, 0, 40, 10), 0.9)]}], images=[im])
    assert s.values[0] == pytest.approx(2 / 3)  # (1, 1, 0): no position term


def test_per_tag_extras_are_nan_off_tag_and_an_empty_include_scores_zero():
    rows = [{"tag": "single_object", "include": [{"class": "bowl", "count": 1}]},
            {"tag": "counting", "include": [{"class": "cup", "count": 1}]},
            {"tag": "single_object", "include": []}]
    s = score(rows, [{"bowl": [(box(0, 0, 5, 5), 0.5)]}, {"cup": [(box(0, 0, 5, 5), 0.5)]}, {}])
    np.testing.assert_array_equal(s.values, [1.0, 0.0, 0.0])  # 0.5 < 0.9 on counting; no terms -> 0 (:263)
    assert set(s.extras) == {"geneval/strict", "geneval/accuracy", *(f"geneval/{t}" for t in TAGS)}
    so, counting = s.extras["geneval/single_object"], s.extras["geneval/counting"]
    assert so[0] == 1 and math.isnan(so[1]) and so[2] == 1  # no clause: strict (correct stays True)
    assert math.isnan(counting[0]) and counting[1] == 0 and np.isnan(s.extras["geneval/position"]).all()
    assert s.values.dtype == np.float32


def test_lenient_evaluate_takes_the_first_count_and_reads_exclude():
    # gen_eval.py:155 objects[:count] and >=; :194-198 exclude
    objects = {"cat": [(box(0, 0, 5, 5, ), None), (box(10, 0, 15, 5), None)]}
    no_colours = lambda *a: pytest.fail("no colour clause")
    assert evaluate(None, objects, {"include": [{"class": "cat", "count": 1}]}, no_colours)
    assert not evaluate(None, objects, {"include": [{"class": "cat", "count": 1}],
                                        "exclude": [{"class": "cat", "count": 2}]}, no_colours)


def test_bad_metadata_and_detector_output_are_named():
    reward = make_reward("geneval", detector=DETECT, colors=COLOURS)
    images = np.zeros((1, H, W, 3), np.uint8)
    with pytest.raises(RewardError, match="prompts=dataset"):
        reward(images, ["p"])  # no metadata at all
    with pytest.raises(RewardError, match="not a GenEval row"):
        reward(images, ["p"], [{"include": []}])
    with pytest.raises(RewardError, match="count >= 1"):
        reward(images, ["p"], [{"tag": "counting", "include": [{"class": "cat", "count": 0}]}])
    with pytest.raises(RewardError, match="reward.detector='nope'"):
        make_reward("geneval", detector="nope")


def _problems(overrides):
    with pytest.raises(ConfigError) as e:
        compose_and_validate(overrides)
    return e.value.problems


def test_compose_time_refusals():
    base = ["+experiment=smoke", "reward=geneval", f"reward.detector={DETECT}", f"reward.colors={COLOURS}"]
    # word-list prompts carry no metadata: refused, naming prompts and the dataset fix
    (p,) = _problems(base)
    assert p.key == "prompts" and p.value == "simple_animals" and "prompts=dataset prompts.path=" in str(p.fix)
    # the reference's backends (conf/reward/geneval.yaml's defaults; the tiny model's reward_local swaps in stand-ins)
    probs = _problems(base[:2] + ["reward.detector=mmdet", "reward.detector_model=null", "reward.colors=open_clip"])
    keys = {q.key for q in probs}
    assert "reward.detector_model" in keys and "prompts" in keys
    import importlib.util
    if importlib.util.find_spec("mmdet") is None:
        (d,) = [q for q in probs if q.key == "reward.detector"]
        assert d.value == "mmdet" and "scripts/reward_envs/geneval_mmdet.sh" in d.reason
    if importlib.util.find_spec("open_clip") is None:
        (c,) = [q for q in probs if q.key == "reward.colors"]
        assert c.value == "open_clip" and c.suggested() == ["reward.colors=clip"]
    (p, *_) = [q for q in _problems(base + ["reward.colors=no_such_module_y:f"]) if q.key != "prompts"]
    assert p.key == "reward.colors" and "not found" in p.reason
    (p, *_) = [q for q in _problems(base[:2] + ["reward.detector=mmdet"]) if q.key == "reward.detector_model"]
    assert p.value == "tiny" and p.suggested() == ["reward.detector=transformers"]


def test_the_tiny_models_stand_ins_run_geneval_in_process(tmp_path):
    """conf/reward_local/geneval_tiny*.yaml: with a tiny model, the transformers detector on a tiny Mask2Former and
    CLIP colours on the tiny CLIP, built in the model cache and resolved by reward_kwargs (rewards/from_config.py)."""
    from ddpo_tpu.rewards.from_config import reward_kwargs

    import json

    folder = tmp_path / "geneval"
    folder.mkdir()
    row = {"tag": "single_object", "include": [{"class": "computer mouse", "count": 1}], "prompt": "a mouse"}
    (folder / "train_metadata.jsonl").write_text(json.dumps(row) + "\n")
    for experiment in ("smoke", "flow_grpo_smoke"):  # model=tiny, model=tiny_sd3
        v = compose_and_validate([f"+experiment={experiment}", "reward=geneval", "prompts=dataset",
                                  f"prompts.path={folder}"])
        c = v.cfg.reward
        assert (c.detector, c.detector_model, c.colors, c.clip_model) == ("transformers", "tiny", "clip", "tiny")
    kwargs = reward_kwargs(c, tmp_path, "cpu")
    assert "tiny-mask2former" in kwargs["detector_model"] and kwargs["clip_model"].endswith("clip")
    reward = make_reward("geneval", **kwargs)
    out = reward.score(np.zeros((2, 40, 56, 3), np.uint8), ["a mouse"] * 2, [row, row])
    assert out.values.shape == (2,) and set(out.extras) >= {"geneval/strict", "geneval/single_object"}


def test_compose_accepts_a_geneval_dataset_and_refuses_rows_without_metadata(tmp_path):
    import json

    rows = [{"tag": "counting", "include": [{"class": "wine glass", "count": 2}],
             "exclude": [{"class": "wine glass", "count": 3}], "prompt": "a photo of two wine glasses"},
            {"tag": "single_object", "include": [{"class": "bowl", "count": 1}], "prompt": "a photo of a bowl"}]
    folder = tmp_path / "geneval"
    folder.mkdir()
    (folder / "train_metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["+experiment=smoke", "reward=geneval", f"reward.detector={DETECT}", f"reward.colors={COLOURS}",
            "prompts=dataset", f"prompts.path={folder}"]
    assert compose_and_validate(base).cfg.reward.detector == DETECT
    # an OCR-style text file carries no metadata: refused naming prompts.path and the prompt
    (tmp_path / "ocr.txt").write_text('a sign that says "OPEN"\n')
    (p,) = _problems(base[:-1] + [f"prompts.path={tmp_path / 'ocr.txt'}"])
    assert p.key == "prompts.path" and "no GenEval metadata" in p.reason and "OPEN" in p.reason
    # a row whose clause has no count
    bad = {"tag": "single_object", "include": [{"class": "bowl"}], "prompt": "a bowl"}
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    (p,) = _problems(base[:-1] + [f"prompts.path={tmp_path / 'bad.jsonl'}"])
    assert p.key == "prompts.path" and "count >= 1" in p.reason
    # evaluation prompts the dataset does not hold have no metadata either
    (p,) = _problems(base + ["evaluation.every_n_epochs=1", "evaluation.prompts=[a photo of a cat]"])
    assert p.key == "evaluation.prompts" and "a photo of a cat" in p.reason
    compose_and_validate(base + ["evaluation.every_n_epochs=1", "evaluation.prompts=[a photo of a bowl]"])


# -- the in-process backends on tiny random-weight models (loaded through from_pretrained) --------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from ddpo_tpu.rewards.tiny_clip import ensure_tiny_aesthetic
    from ddpo_tpu.rewards.tiny_mask2former import ensure_tiny_mask2former

    root = tmp_path_factory.mktemp("geneval_models")
    return ensure_tiny_mask2former(root), ensure_tiny_aesthetic(root)[0]


def test_transformers_detector_maps_coco_labels_and_feeds_the_rules(tiny_models):
    from ddpo_tpu.rewards.geneval import DETECTORS

    m2f, clip = tiny_models
    images = np.random.default_rng(0).integers(0, 256, (2, 48, 64, 3), dtype=np.uint8)
    found = DETECTORS["transformers"](model=str(m2f))(list(images))
    assert len(found) == 2
    for dets in found:
        assert set(dets) == {"computer mouse"}  # the checkpoint's "mouse" is GenEval's "computer mouse"
        for b, p, mask in dets["computer mouse"]:
            assert mask.shape == (48, 64) and mask.dtype == bool and 0.3 < p <= 1
            ys, xs = np.nonzero(mask)  # the box is the mask's extent
            np.testing.assert_array_equal(b, [xs.min(), ys.min(), xs.max(), ys.max()])
    # through the reward: one mouse asked for, n found above 0.3 -> 1 - |1 - n| (gen_eval.py:219)
    n = [sum(p > 0.3 for _, p, _ in d["computer mouse"]) for d in found]
    reward = make_reward("geneval", detector="transformers", detector_model=str(m2f), colors="clip",
                         clip_model=str(clip))
    row = {"tag": "single_object", "include": [{"class": "computer mouse", "count": 1}]}
    np.testing.assert_allclose(reward(images, ["a photo of a computer mouse"] * 2, [row, row]),
                               [1 - abs(1 - k) for k in n])


def test_clip_colours_are_the_zero_shot_argmax_of_the_three_templates(tiny_models):
    # clip_benchmark zero_shot_classifier: per colour, mean of the unit text embeddings of the 3 templates, renormed;
    # run_classification: argmax of the unit image embedding against them (gen_eval.py:88-106). Computed here in one
    # batch of 30 texts, apart from the classifier's per-colour loop.
    import torch
    from transformers import CLIPModel, CLIPTokenizer

    from ddpo_tpu.rewards.clip_score import image_features, load_clip
    from ddpo_tpu.rewards.geneval import COLOR_CLASSIFIERS, COLORS, COLOR_TEMPLATES

    _, clip = tiny_models
    crops = [np.random.default_rng(i).integers(0, 256, (10 + 7 * i, 20 + 3 * i, 3), dtype=np.uint8) for i in range(6)]
    got = COLOR_CLASSIFIERS["clip"](clip_model=str(clip))(crops, "car")
    processor, _, model, dev = load_clip("geneval", str(clip), True, "cpu")
    tok = CLIPTokenizer.from_pretrained(clip)
    texts = [t.format(c=c, cls="car") for c in COLORS for t in COLOR_TEMPLATES]
    with torch.no_grad():
        emb = model.get_text_features(**tok(texts, padding=True, return_tensors="pt"))
        emb = emb if torch.is_tensor(emb) else emb.pooler_output
        w = torch.nn.functional.normalize(torch.nn.functional.normalize(emb, dim=-1).view(10, 3, -1).mean(1), dim=-1)
        img = torch.nn.functional.normalize(torch.cat([image_features(processor, model, c[None], dev) for c in crops]),
                                            dim=-1)
    assert got == [COLORS[i] for i in (img @ w.T).argmax(1).tolist()]
    assert len(set(got)) >= 1 and all(g in COLORS for g in got)
    assert isinstance(model, CLIPModel)


# -- in a training run ----------------------------------------------------------------------------------------------

# tests/data/flow_grpo/geneval/train_metadata.jsonl's prompts, scored by hand under detect_everything + all_brown
# (each class found once, whole-image boxes, every colour brown): counting 4 -> 1 - 3/4; counting 3 -> 1 - 2/3;
# position: identical boxes hold no relation -> (1, 1, 0.0, 1.0); colour_attr yellow / pink -> (1, 0, 1, 0)
BY_HAND = {"a photo of four stop signs": (0.25, 0), "a photo of three oranges": (1 / 3, 0),
           "a photo of a fork": (1.0, 1), "a photo of a chair left of a zebra": (0.75, 0),
           "a photo of a broccoli and a vase": (1.0, 1), "a photo of a brown chair": (1.0, 1),
           "a photo of a yellow dining table and a pink dog": (0.5, 0), "a photo of a frisbee and an apple": (1.0, 1)}


@pytest.mark.slow  # a tiny SD3 epoch in-process: 54 s on 2 busy cores, most of it the model build a session shares
# managed: the reward (with the stub detector, as a GenEval environment's mmdet would be) in a process of its own
# (reward.process.python: this interpreter, rewards/managed.py); its scores come back over the wire with the extras
@pytest.mark.parametrize("managed", [False, True], ids=["in_process", "managed_process"])
def test_a_geneval_run_trains_on_the_partial_credit_and_logs_strict_and_per_tag_accuracy(tmp_path, model_cache,
                                                                                          managed):
    import json
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop
    from tests.helpers import read_metrics

    data = Path(__file__).parents[2] / "data" / "flow_grpo" / "geneval"
    rows = [json.loads(line) for line in (data / "train_metadata.jsonl").read_text().splitlines()]
    assert {r["prompt"] for r in rows} == set(BY_HAND)
    v = compose_and_validate([
        "+experiment=flow_grpo_smoke", "num_epochs=1", "sample.batch_size=8", "sample.num_batches_per_epoch=1",
        "train.batch_size=8", "train.gradient_accumulation_steps=1", "algorithm.group_size=4", "sample.num_steps=2",
        "prompts=dataset",
        f"prompts.path={data}", "reward=geneval", "reward.detector=tests.helpers.reward_stubs:detect_everything",
        "reward.colors=tests.helpers.reward_stubs:all_brown", "reward.host_workers=0",
        f"model.cache_dir={model_cache}", *([f"reward.process.python={sys.executable}"] if managed else [])])
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    if managed:
        from ddpo_tpu.rewards.managed import ManagedReward

        assert isinstance(tr.reward, ManagedReward)
        pid = tr.reward.pid
    calls = []
    score = tr.reward.score

    def recording(images, prompts, metadata=None):
        out = score(images, prompts, metadata=metadata)
        calls.append((list(prompts), out))
        return out

    tr.reward.score = recording
    try:
        tr.fit()
    finally:
        if managed:
            tr.reward.close()
    if managed:  # the process served the epoch, and is gone after close
        assert (tmp_path / "reward_process.log").is_file()
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    (prompts, out), = calls
    np.testing.assert_allclose(out.values, [BY_HAND[p][0] for p in prompts], rtol=1e-6)
    strict = np.array([BY_HAND[p][1] for p in prompts], float)
    np.testing.assert_array_equal(out.extras["geneval/strict"], strict)
    epoch = read_metrics(tmp_path, "epoch")[0]
    assert epoch["reward_mean"] == pytest.approx(out.values.mean(), rel=1e-6)
    extras = epoch["reward_extras"]
    assert extras["geneval/strict"] == pytest.approx(strict.mean())
    tags = {r["prompt"]: r["tag"] for r in rows}
    for tag in TAGS:  # per-tag strict accuracy over that tag's images; null where the epoch drew none
        mine = [BY_HAND[p][1] for p in prompts if tags[p] == tag]
        assert extras[f"geneval/{tag}"] == (pytest.approx(np.mean(mine)) if mine else None), tag


def test_a_geneval_preset_evaluating_its_test_split_composes(tmp_path):
    """The references evaluate GenEval on the test split: with evaluation.split set, the fixed evaluation.prompts (a
    cat, a dog: no metadata) are not read, so they are not judged; a split's own rows are."""
    import sys
    from pathlib import Path

    data = Path(__file__).parents[2] / "data" / "flow_grpo" / "geneval"
    (tmp_path / "m2f.pth").write_bytes(b"placeholder")
    run = ["+experiment=flow_grpo_geneval_sd35", f"prompts.path={data}",
           f"reward.detector_model={tmp_path / 'm2f.pth'}", f"reward.process.python={sys.executable}",
           "evaluation.every_n_epochs=60"]
    with pytest.raises(ConfigError) as e:  # the fixed prompts carry no GenEval metadata
        compose_and_validate(run)
    assert "GenEval metadata" in e.value.render()
    cfg = compose_and_validate([*run, "evaluation.split=test"]).cfg
    assert cfg.evaluation.split == "test"
