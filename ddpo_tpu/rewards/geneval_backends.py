"""GenEval's built-in backends (rewards/geneval.py holds the rules): the reference's mmdet Mask2Former, transformers'
Mask2Former (an in-process approximation), and the zero-shot colour classifiers (open_clip as the reference, or the same
weights through transformers' CLIP). Each registers under its name; heavy imports happen when one is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ddpo_tpu.rewards.base import RewardError
from ddpo_tpu.rewards.geneval import (_ALIASES, _NAME, CLASSNAMES, COLOR_TEMPLATES, COLORS, THRESHOLD, ColorClassifier,
                                      Detection, Detector, register_color_classifier, register_detector)


def geneval_class(label: str) -> str | None:
    """A detector's label as GenEval's class name (None: not one of the 80)."""
    name = label.strip().lower().replace("_", " ")
    name = _ALIASES.get(name, name)
    return name if name in CLASSNAMES else None


@register_detector("mmdet")
def mmdet_detector(model: str | None = None, config: str | None = None, device: Any = "cpu",
                   **_: Any) -> Detector:
    """The reference's detector (gen_eval.py:40-47, 267-271; DiffusionNFT's config path): mmdet 2.x init_detector +
    inference_detector; per class index i of CLASSNAMES, bbox[i] (N, 5) and segm[i] (N masks)."""
    try:
        import mmdet
        from mmdet.apis import inference_detector, init_detector
    except ImportError as exc:
        raise RewardError(_NAME, f"reward.detector='mmdet' needs mmdet 2.x and mmcv-full 1.x ({exc}): build their "
                                 "environment with scripts/reward_envs/geneval_mmdet.sh") from None
    if not model:
        raise RewardError(_NAME, "reward.detector_model=null: detector=mmdet needs the Mask2Former checkpoint")
    config = config or str(Path(mmdet.__file__).parent.parent / "configs" / "mask2former"
                           / "mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py")
    net = init_detector(config, str(Path(model).expanduser()), device=str(device))

    def detect(images: Sequence[np.ndarray]) -> list[dict[str, list[Detection]]]:
        out = []
        for result in inference_detector(net, list(images)):
            bbox = result[0] if isinstance(result, tuple) else result
            segm = result[1] if isinstance(result, tuple) and len(result) > 1 else None
            out.append({cls: [(b[:4], float(b[4]), None if segm is None else segm[i][j])
                              for j, b in enumerate(bbox[i])] for i, cls in enumerate(CLASSNAMES)})
        return out

    return detect


TRANSFORMERS_DETECTOR = "facebook/mask2former-swin-small-coco-instance"


def _local_or_hub(name: str) -> str:
    path = Path(name).expanduser()
    return str(path) if path.exists() else name


@register_detector("transformers")
def transformers_detector(model: str | None = None, device: Any = "cpu", local_files_only: bool = True,
                          **_: Any) -> Detector:
    """transformers' Mask2Former (instance segmentation: masks, boxes from the masks' extents) or a DETR-style
    object detector (boxes only). Detections above THRESHOLD leave post-processing; keep_detections filters further."""
    import torch
    from transformers import AutoConfig, AutoImageProcessor

    source = _local_or_hub(model or TRANSFORMERS_DETECTOR)
    try:
        cfg = AutoConfig.from_pretrained(source, local_files_only=local_files_only)
        processor = AutoImageProcessor.from_pretrained(source, local_files_only=local_files_only)
        if cfg.model_type in ("mask2former", "maskformer", "oneformer"):
            from transformers import AutoModelForUniversalSegmentation as Auto
            segmentation = True
        else:
            from transformers import AutoModelForObjectDetection as Auto
            segmentation = False
        net = Auto.from_pretrained(source, local_files_only=local_files_only)
    except Exception as exc:  # noqa: BLE001 -- one line naming the key
        raise RewardError(_NAME, f"reward.detector_model={model!r} cannot be loaded ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}); download it once "
                                 f"(hf download {TRANSFORMERS_DETECTOR}) or give a local directory") from None
    net = net.to(torch.device(device)).eval().requires_grad_(False)
    labels = {int(k): geneval_class(v) for k, v in net.config.id2label.items()}

    def detect(images: Sequence[np.ndarray]) -> list[dict[str, list[Detection]]]:
        inputs = processor(images=list(images), return_tensors="pt")
        with torch.no_grad():
            outputs = net(**{k: v.to(net.device) for k, v in inputs.items()})
        sizes = [im.shape[:2] for im in images]
        out = []
        if segmentation:
            results = processor.post_process_instance_segmentation(outputs, threshold=THRESHOLD, target_sizes=sizes,
                                                                   return_binary_maps=True)
            for res in results:
                found: dict[str, list[Detection]] = {}
                seg = res["segmentation"]
                for k, info in enumerate(res["segments_info"]):
                    cls = labels.get(int(info["label_id"]))
                    mask = None if seg is None else seg[k].cpu().numpy().astype(bool)
                    if cls is None or mask is None or not mask.any():
                        continue
                    ys, xs = np.nonzero(mask)
                    box = np.array([xs.min(), ys.min(), xs.max(), ys.max()], np.float64)
                    found.setdefault(cls, []).append((box, float(info["score"]), mask))
                out.append(found)
        else:
            results = processor.post_process_object_detection(outputs, threshold=THRESHOLD, target_sizes=sizes)
            for res in results:
                found = {}
                for score, label, box in zip(res["scores"], res["labels"], res["boxes"]):
                    cls = labels.get(int(label))
                    if cls is not None:
                        found.setdefault(cls, []).append((box.cpu().numpy().astype(np.float64), float(score), None))
                out.append(found)
        return out

    return detect


@register_color_classifier("clip")
def clip_color_classifier(clip_model: str = "openai/clip-vit-large-patch14", device: Any = "cpu",
                          local_files_only: bool = True, **_: Any) -> ColorClassifier:
    """CLIP zero-shot over COLORS with the reference's three templates (gen_eval.py:88-106): each colour's weight the
    normalised mean of its templates' normalised text embeddings (clip_benchmark's zero_shot_classifier); a crop's
    colour the argmax of 100 x cosine (run_classification). Weights: openai/clip-vit-large-patch14, the reference's
    open_clip ViT-L-14 `openai`; preprocessing: CLIP's image processor (224 px bicubic resize, centre crop, CLIP
    mean/std), loaded as clip_score loads it (rewards/clip_score.py load_clip)."""
    import torch
    from transformers import CLIPTokenizer

    from ddpo_tpu.rewards.clip_score import image_features, load_clip
    from ddpo_tpu.rewards.pickscore import _projected

    processor, tokenizer, model, dev = load_clip(_NAME, clip_model, local_files_only, device, CLIPTokenizer)
    model = model.float()
    weights: dict[str, Any] = {}

    def text_weights(classname: str):
        rows = []
        for c in COLORS:
            tok = tokenizer([t.format(c=c, cls=classname) for t in COLOR_TEMPLATES], padding=True,
                            return_tensors="pt")
            emb = _projected(model.get_text_features(**{k: v.to(dev) for k, v in tok.items()}))
            emb = torch.nn.functional.normalize(emb, dim=-1).mean(dim=0)
            rows.append(emb / emb.norm())
        return torch.stack(rows, dim=1)  # (D, colours)

    def classify(crops: list[np.ndarray], classname: str) -> list[str]:
        if not crops:
            return []
        with torch.no_grad():
            if classname not in weights:
                weights[classname] = text_weights(classname)
            # crops differ in size: the processor resizes each (one at a time keeps input_data_format simple)
            feats = torch.cat([image_features(processor, model, c[None], dev) for c in crops])
            feats = torch.nn.functional.normalize(feats, dim=-1)
            pred = (100.0 * feats @ weights[classname]).argmax(dim=1)
        return [COLORS[int(i)] for i in pred]

    return classify


@register_color_classifier("open_clip")
def open_clip_color_classifier(device: Any = "cpu", **_: Any) -> ColorClassifier:
    """The reference's own classifier (gen_eval.py:49-51, 88-106): open_clip ViT-L-14 `openai` with its transform and
    clip_benchmark's zero-shot weights -- for the mmdet environment, where open_clip is installed. Weights come from
    open_clip's cache (downloaded once by scripts/reward_envs/geneval_mmdet.sh)."""
    import open_clip
    import torch
    from PIL import Image

    model, _, transform = open_clip.create_model_and_transforms("ViT-L-14", pretrained="openai", device=str(device))
    tokenizer = open_clip.get_tokenizer("ViT-L-14")
    model.eval()
    weights: dict[str, Any] = {}

    def classify(crops: list[np.ndarray], classname: str) -> list[str]:
        if not crops:
            return []
        with torch.no_grad():
            if classname not in weights:
                rows = []
                for c in COLORS:
                    emb = model.encode_text(tokenizer([t.format(c=c, cls=classname) for t in COLOR_TEMPLATES])
                                            .to(device))
                    emb = torch.nn.functional.normalize(emb, dim=-1).mean(dim=0)
                    rows.append(emb / emb.norm())
                weights[classname] = torch.stack(rows, dim=1)
            pixels = torch.stack([transform(Image.fromarray(c)) for c in crops]).to(device)
            feats = torch.nn.functional.normalize(model.encode_image(pixels), dim=-1)
            pred = (100.0 * feats @ weights[classname]).argmax(dim=1)
        return [COLORS[int(i)] for i in pred]

    return classify
