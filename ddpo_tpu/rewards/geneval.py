"""GenEval reward: the object, count, colour and position rules of GenEval as DiffusionNFT trains on them, computed
in-process from detections (yifan123/reward-server@92ac29f reward_server/gen_eval.py; NVlabs/DiffusionNFT@24af555
flow_grpo/gen_eval.py runs the same code inside its trainer -- the two differ only in formatting and model paths).

Each image comes with its prompt's metadata row (prompts=dataset on a GenEval ``*_metadata.jsonl``): ``tag`` (one of
single_object, two_object, counting, colors, position, color_attr), ``include`` ([{class, count, color?, position?}])
and ``exclude`` ([{class, count}]). In the reference's order (line numbers of reward-server@92ac29f gen_eval.py):

1. Detections per class (the detector backend): sorted by score, kept above 0.3 (0.9 when the tag is ``counting``),
   at most 16 per class, then the NMS loop -- which never removes anything, as NMS_THRESHOLD is 1.0 (274-289, 312-316).
2. ``evaluate_reward`` (214-264), per include clause: the count term ``1 - |count - found| / count`` over *all* kept
   detections of the class; found != count -> not strict, and one 0.0 term when the clause has a colour or a position.
   Otherwise colour: the crops' colours (below), term ``1 - |count - n_colour| / count``, n_colour != count -> not
   strict. Then, if still matched and the clause has a position: no matched target group -> a 0.0 term; else every
   (object, target object) pair must hold the expected relation; the first failure appends 0.0, and a 1.0 term is
   appended after the loop either way (so a failed position clause contributes 0.0 and 1.0: the reference's
   arithmetic, kept). Exclude clauses are not read here. score = mean of the terms (0 with none).
3. ``evaluate`` (139-199, the benchmark's lenient accuracy, logged only with lenient_accuracy=true): the first
   ``count`` detections must exist (>=), colours and positions on those; an exclude clause fails when the class has
   >= count detections.

The value that trains is the partial-credit ``score``: DiffusionNFT's multi_score adds ``weight * scores``
(DiffusionNFT@24af555 flow_grpo/rewards.py:276-300) and logs strict/lenient accuracy beside it. Extras here:
``geneval/strict`` (0/1, the reference's strict_correct), ``geneval/<tag>`` (strict 0/1 for the images of that tag,
NaN elsewhere; the reference fills -10 there, compute_geneval 320-340) and with lenient_accuracy ``geneval/accuracy``.

Colours (87-106): each object's crop is the image composited over a #999 grey background through the object's mask
(no mask: the image itself), cropped to its box; CLIP ViT-L/14 zero-shot over 10 colours, each colour's text
embedding the normalised mean of the normalised embeddings of three templates ("a photo of a {c} {class}",
"a photo of a {c}-colored {class}", "a photo of a {c} object"), argmax of the cosine (clip_benchmark's
zero_shot_classifier / run_classification). ``colors=open_clip`` is the reference's open_clip ViT-L-14 `openai` with
its own transform (in the mmdet environment); ``colors=clip`` the same weights through transformers' CLIPModel and
CLIPProcessor (resize 224 bicubic, centre crop, the same mean/std: the same steps, not bit-identical pixels);
``colors=module:function`` your own, ``(crops, classname) -> colour names``.

Positions (119-136): centres and sizes of the two boxes; the offset shrunk by 0.1 x (sum of sizes) per axis; below
1e-3 on both axes -> no relation; else, divided by the offset's norm, dx < -0.5 "left of", > 0.5 "right of", dy < -0.5
"above", > 0.5 "below".

Detectors (``detector``), each ``(list of uint8 (H, W, 3) RGB images) -> per image {class: [(box xyxy, score, mask
or None), ...]}``, class names GenEval's 80 COCO names (``CLASSNAMES``):

* ``mmdet`` -- the reference's Mask2Former Swin-S COCO (mmdet 2.x, mmcv-full 1.x: its own environment,
  scripts/reward_envs/geneval_mmdet.sh; run the reward there through the managed reward process). Images go in as
  the reference passes them (RGB arrays, 312 of gen_eval.py ``np.array(image_pil)``). The parity backend.
* ``transformers`` -- transformers' Mask2Former (facebook/mask2former-swin-small-coco-instance: the same
  architecture and training set, a different checkpoint and post-processing) or any DETR-style object detector
  (boxes only: colours then come from the unmasked box crop). An approximation: its scores are not the reference's.
* ``module:function`` -- your own (tests use a stub detector).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, RewardError, RewardScores, register_reward

__all__ = ["CLASSNAMES", "COLORS", "DETECTORS", "COLOR_CLASSIFIERS", "TAGS", "GenevalReward", "color_crops",
           "compute_iou", "evaluate", "evaluate_reward", "keep_detections", "relative_position", "register_detector",
           "register_color_classifier"]

_NAME = "geneval"

THRESHOLD = 0.3           # gen_eval.py:312
COUNTING_THRESHOLD = 0.9  # :313
MAX_OBJECTS = 16          # :314
NMS_THRESHOLD = 1.0       # :315 (1.0: the NMS loop keeps everything)
POSITION_THRESHOLD = 0.1  # :316
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")  # :59
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")  # :92-95
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")  # :321
# reward-server@92ac29f reward_server/object_names.txt (= DiffusionNFT flow_grpo/assets/object_names.txt): COCO's 80
CLASSNAMES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant",
    "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
    "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli",
    "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet",
    "tv", "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster",
    "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
# other spellings of the same COCO classes (detectron2 / transformers' id2label) -> GenEval's
_ALIASES = {"mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard",
            "hair dryer": "hair drier",
            "motorbike": "motorcycle", "aeroplane": "airplane", "sofa": "couch", "pottedplant": "potted plant",
            "diningtable": "dining table", "tvmonitor": "tv", "doughnut": "donut"}

Detection = tuple  # (box xyxy (4,), score, mask bool (H, W) or None)
Detector = Callable[[Sequence[np.ndarray]], list[Mapping[str, Sequence[Detection]]]]
ColorClassifier = Callable[[list[np.ndarray], str], list[str]]

DETECTORS: dict[str, Callable[..., Detector]] = {}
COLOR_CLASSIFIERS: dict[str, Callable[..., ColorClassifier]] = {}


def register_detector(name: str):
    def decorator(factory):
        DETECTORS[name] = factory
        return factory
    return decorator


def register_color_classifier(name: str):
    def decorator(factory):
        COLOR_CLASSIFIERS[name] = factory
        return factory
    return decorator


def _resolve(spec: str, registry: dict[str, Callable[..., Any]], key: str, **options: Any) -> Any:
    """A registered backend built with ``options``, or ``module:function`` (the function itself)."""
    if spec in registry:
        return registry[spec](**options)
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise RewardError(_NAME, f"{key}={spec!r} cannot be imported ({type(exc).__name__}: {exc})") from None
        if not callable(fn):
            raise RewardError(_NAME, f"{key}={spec!r} is not callable")
        return fn
    raise RewardError(_NAME, f"{key}={spec!r}: unknown; use one of {sorted(registry)} or module:function")


# -- the rules ------------------------------------------------------------------------------------------------------


def compute_iou(box_a, box_b) -> float:
    """gen_eval.py:109-116: inclusive-pixel areas (+1)."""
    def area(b):
        return max(b[2] - b[0] + 1, 0) * max(b[3] - b[1] + 1, 0)
    inter = area([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]), min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    union = area(box_a) + area(box_b) - inter
    return inter / union if union else 0


def keep_detections(raw: Mapping[str, Sequence[Detection]], tag: str) -> dict[str, list[tuple[np.ndarray, Any]]]:
    """gen_eval.py:274-289: per class, (box + score (5,), mask) sorted by score, above the tag's threshold, at most
    MAX_OBJECTS, through the (inactive) NMS loop; classes left with none are absent."""
    threshold = THRESHOLD if tag != "counting" else COUNTING_THRESHOLD
    detected: dict[str, list[tuple[np.ndarray, Any]]] = {}
    for classname, dets in raw.items():
        if not dets:
            continue
        bbox = np.array([[*np.asarray(d[0], dtype=np.float64)[:4], float(d[1])] for d in dets], dtype=np.float64)
        masks = [d[2] if len(d) > 2 else None for d in dets]
        ordering = np.argsort(bbox[:, 4])[::-1]
        ordering = ordering[bbox[ordering, 4] > threshold]
        ordering = ordering[:MAX_OBJECTS].tolist()
        kept = []
        while ordering:
            top = ordering.pop(0)
            kept.append((bbox[top], masks[top]))
            ordering = [o for o in ordering if NMS_THRESHOLD == 1 or compute_iou(bbox[top], bbox[o]) < NMS_THRESHOLD]
        if kept:
            detected[classname] = kept
    return detected


def relative_position(obj_a, obj_b) -> set[str]:
    """gen_eval.py:119-136: where A is relative to B, sizes factored in."""
    boxes = np.array([obj_a[0], obj_b[0]])[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def color_crops(image: np.ndarray, objects: Sequence[tuple[Any, Any]]) -> list[np.ndarray]:
    """gen_eval.py:64-85: each object's mask composites the image over #999 grey (no mask: the image), then the box
    crop (PIL's crop of the float box, as the reference)."""
    from PIL import Image

    pil = Image.fromarray(np.ascontiguousarray(image)).convert("RGB")
    blank = Image.new("RGB", pil.size, color="#999")
    crops = []
    for box, mask in objects:
        if mask is not None:
            mask = np.asarray(mask)
            if tuple(mask.shape) != tuple(pil.size[::-1]):
                raise RewardError(_NAME, f"a mask of shape {mask.shape} for an image of {pil.size[::-1]}")
            composed = Image.composite(pil, blank, Image.fromarray(mask.astype(bool)))
        else:
            composed = pil
        crops.append(np.asarray(composed.crop(tuple(float(x) for x in np.asarray(box)[:4]))))
    return crops


ClassifyFn = Callable[[np.ndarray, Sequence[tuple[Any, Any]], str], list[str]]


def evaluate_reward(image: np.ndarray, objects: Mapping[str, list], metadata: Mapping[str, Any],
                    classify: ClassifyFn) -> tuple[bool, float]:
    """gen_eval.py:201-264: (strict correctness, partial-credit score); see the module docstring."""
    correct = True
    rewards: list[float] = []
    matched_groups: list[Any] = []
    for req in metadata.get("include", []):
        classname, count = req["class"], req["count"]
        matched = True
        found = objects.get(classname, [])
        rewards.append(1 - abs(count - len(found)) / count)
        if len(found) != count:
            correct = matched = False
            if "color" in req or "position" in req:
                rewards.append(0.0)
        else:
            if "color" in req:
                colors = classify(image, found, classname)
                rewards.append(1 - abs(count - colors.count(req["color"])) / count)
                if colors.count(req["color"]) != count:
                    correct = matched = False
            if "position" in req and matched:
                expected_rel, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                    rewards.append(0.0)
                else:
                    for obj in found:
                        for target_obj in matched_groups[target_group]:
                            if expected_rel not in relative_position(obj, target_obj):
                                correct = matched = False
                                rewards.append(0.0)
                                break
                        if not matched:
                            break
                    rewards.append(1.0)  # after the loop, failed or not (gen_eval.py:258)
        matched_groups.append(found if matched else None)
    return correct, (sum(rewards) / len(rewards) if rewards else 0)


def evaluate(image: np.ndarray, objects: Mapping[str, list], metadata: Mapping[str, Any],
             classify: ClassifyFn) -> bool:
    """gen_eval.py:139-199: the benchmark's lenient correctness (the first `count` detections, >= counts)."""
    correct = True
    matched_groups: list[Any] = []
    for req in metadata.get("include", []):
        classname, count = req["class"], req["count"]
        matched = True
        found = objects.get(classname, [])[:count]
        if len(found) < count:
            correct = matched = False
        else:
            if "color" in req:
                if classify(image, found, classname).count(req["color"]) < count:
                    correct = matched = False
            if "position" in req and matched:
                expected_rel, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                else:
                    for obj in found:
                        for target_obj in matched_groups[target_group]:
                            if expected_rel not in relative_position(obj, target_obj):
                                correct = matched = False
                                break
                        if not matched:
                            break
        matched_groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
    return correct


# -- the reward -----------------------------------------------------------------------------------------------------


def _check_row(i: int, row: Any) -> None:
    if not isinstance(row, Mapping) or "tag" not in row or not isinstance(row.get("include", []), list):
        raise RewardError(_NAME, f"image {i}'s prompt metadata {row!r} is not a GenEval row (tag, include, exclude); "
                                 "use prompts=dataset prompts.path=.../geneval")
    for req in [*row.get("include", []), *row.get("exclude", [])]:
        if not isinstance(req, Mapping) or "class" not in req or not isinstance(req.get("count"), int) \
                or req["count"] < 1:
            raise RewardError(_NAME, f"image {i}: clause {req!r} needs a class and a count >= 1")


@register_reward(_NAME)
class GenevalReward(Reward):
    """Partial-credit GenEval score per image (its prompt's metadata); extras: strict and per-tag accuracy."""

    name = _NAME

    def __init__(self, detector: str = "mmdet", detector_model: str | None = None, detector_config: str | None = None,
                 colors: str = "open_clip", clip_model: str = "openai/clip-vit-large-patch14",
                 lenient_accuracy: bool = False, device: Any = "cpu", local_files_only: bool = True):
        self.lenient_accuracy = lenient_accuracy
        options = {"model": detector_model, "config": detector_config, "device": device,
                   "local_files_only": local_files_only}
        self.detect: Detector = _resolve(detector, DETECTORS, "reward.detector", **options)
        self._colors_spec, self._color_options = colors, {"clip_model": clip_model, "device": device,
                                                          "local_files_only": local_files_only}
        self._classify_crops: ColorClassifier | None = None

    def classify(self, image: np.ndarray, objects: Sequence[tuple[Any, Any]], classname: str) -> list[str]:
        if self._classify_crops is None:  # built on the first colour clause (CLIP-L is not loaded for counting-only)
            self._classify_crops = _resolve(self._colors_spec, COLOR_CLASSIFIERS, "reward.colors",
                                            **self._color_options)
        names = list(self._classify_crops(color_crops(image, objects), classname))
        if len(names) != len(objects):
            raise self._error(f"the colour classifier returned {len(names)} colours for {len(objects)} objects")
        return names

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self.score(images, prompts, metadata).values

    def score(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
        images = self._check_host_images(images, prompts)
        if metadata is None or len(metadata) != len(images):
            raise self._error("needs each prompt's GenEval metadata (tag, include, exclude): use prompts=dataset "
                              "prompts.path=.../geneval")
        for i, row in enumerate(metadata):
            _check_row(i, row)
        raw = list(self.detect([np.ascontiguousarray(im) for im in images]))
        if len(raw) != len(images):
            raise self._error(f"the detector returned {len(raw)} results for {len(images)} images")
        n = len(images)
        values = np.zeros(n, np.float32)
        strict = np.zeros(n, np.float32)
        # the same extras every call (the processes gather them by name): the six tags; another tag counts in strict
        per_tag = {t: np.full(n, math.nan, np.float32) for t in TAGS}
        lenient = np.zeros(n, np.float32)
        for i, (image, dets, row) in enumerate(zip(images, raw, metadata)):
            objects = keep_detections(dets, row["tag"])
            ok, values[i] = evaluate_reward(image, objects, row, self.classify)
            strict[i] = float(ok)
            if row["tag"] in per_tag:
                per_tag[row["tag"]][i] = float(ok)
            if self.lenient_accuracy:
                lenient[i] = float(evaluate(image, objects, row, self.classify))
        extras = {"geneval/strict": strict, **{f"geneval/{t}": v for t, v in per_tag.items()}}
        if self.lenient_accuracy:
            extras["geneval/accuracy"] = lenient
        return RewardScores(values, extras)
