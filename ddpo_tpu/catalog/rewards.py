"""Rewards: each one's config keys (a pydantic model: the reward constructor's keyword arguments), the module that
registers its torch/numpy implementation, and what the schema cannot say about its keys. The schema builds the
`reward` group (and reward=weighted's components) from this registry, so a reward is known by registering it here.
Adding a reward: its keys class and spec here, its module (a `@register_reward` constructor, ddpo_tpu/rewards) and
conf/reward/<name>.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from ddpo_tpu.catalog.registry import Registry
from ddpo_tpu.catalog.reward_checks import (  # noqa: F401 -- re-exported: callers import them from here
    TINY, PROMPTED_DIGIT, OPTIONAL_BACKENDS, backend_problems, OCR_RECOGNIZERS, GENEVAL_DETECTORS, GENEVAL_COLORS,
    quoted_text, url_problems, IMAGEREWARD_FILES, HPSV2_FILES, _tiny_pair, _aesthetic_problems,
    _imagereward_problems, _hpsv2_problems, _ocr_problems, _ocr_prompt_problems, _geneval_problems,
    _geneval_source_problems, _vlm_judge_problems, _prompted_digit_problems, _in_own_process, _hf_cached,
    _geneval_row_problem)
from ddpo_tpu.problems import Problem


class Keys(BaseModel):
    # strict: "4" is not an int and 1.5 is not an int; ints are accepted where floats are expected.
    # no inf/nan: Hydra parses `inf` and `nan` as floats, and no key of a run means either
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


@dataclass(frozen=True)
class RewardSpec:
    name: str
    title: str
    keys: type[Keys]     # with `name: Literal[<name>]`
    module: str          # importing it registers the implementation (ddpo_tpu.rewards.base.register_reward)
    torch: bool = False  # runs a torch model and takes a `device`
    # the schema cannot say: (keys, dotted prefix) -> problems (files that must exist, URLs, pairs of stand-ins)
    problems: Callable[[Any, str], list[Problem]] = lambda keys, prefix: []
    composite: bool = False  # holds other rewards (weighted): not itself a component
    # a feature model (B, D), not a score: never a run's reward or a component; GRPO's diversity_features takes one
    features: bool = False
    # what it scores: uint8 images (B, H, W, 3), or videos (B, F, H, W, 3) as a video family decodes them
    # (FamilySpec.output). An image reward on a video family scores every frame and reduces the frames' scores by its
    # `frame_reduction` key (rewards/video.py); a video reward on an image family is refused at compose time.
    takes: Literal["images", "videos"] = "images"
    # what it needs of the prompts: (keys, dotted prefix, the prompt source's word lists (a prompt is one word of
    # each), the evaluation prompts) -> problems (config/inputs.py calls it for the run's reward and each component)
    prompt_problems: Callable[[Any, str, Any, list[str]], list[Problem]] = lambda keys, prefix, parts, evals: []
    # what it needs of the prompt source itself: (keys, dotted prefix, the `prompts` config, the built source, the
    # evaluation prompts) -> problems (GenEval needs each prompt's metadata, which only prompts=dataset carries;
    # config/inputs.py calls it beside prompt_problems)
    source_problems: Callable[[Any, str, Any, Any, list[str]], list[Problem]] = \
        lambda keys, prefix, prompts, source, evals: []


REWARDS: Registry[RewardSpec] = Registry("reward")


FRAME_REDUCTIONS = ("mean", "min")  # rewards/video.py PerFrame


class FrameReductionKeys(Keys):
    """The key every image reward gets from the schema (config/schema.py): how a video family turns its frames'
    scores into the video's. mean: the plain video score (flow_grpo's Wan script scores whole videos); min: the worst
    frame. Read only with a video family (config/enablement.py)."""

    frame_reduction: Literal["mean", "min"] = "mean"


class _JpegKeys(Keys):
    quality: int = Field(default=95, ge=1, le=100)  # JPEG quality the size is measured at (the reference's 95)


class JpegCompressibilityKeys(_JpegKeys):
    name: Literal["jpeg_compressibility"]


class JpegIncompressibilityKeys(_JpegKeys):
    name: Literal["jpeg_incompressibility"]


class AestheticKeys(Keys):
    name: Literal["aesthetic"]
    clip_model: str = Field(default="openai/clip-vit-large-patch14", min_length=1)  # hub id, local dir or `tiny`
    mlp_path: str | None = None                        # LAION MLP weights (.pth/.safetensors) or `tiny`; required
    batch_size: int | None = Field(default=None, ge=1)  # images per forward pass (null: the whole batch)


class ClipScoreKeys(Keys):
    name: Literal["clip_score"]
    clip_model: str = Field(default="openai/clip-vit-large-patch14", min_length=1)  # hub id, local dir or `tiny`


class FrameConsistencyKeys(Keys):
    name: Literal["frame_consistency"]
    # VBench's background consistency model, CLIP ViT-B/32 (Vchitect/VBench@45e79ec vbench/utils.py:244-252): hub id,
    # local dir or `tiny`
    clip_model: str = Field(default="openai/clip-vit-base-patch32", min_length=1)
    batch_size: int | None = Field(default=None, ge=1)  # frames per CLIP forward pass (null: all of a batch's)


class PickScoreKeys(Keys):
    name: Literal["pickscore"]
    clip_model: str = Field(default="yuvalkirstain/PickScore_v1", min_length=1)  # CLIPModel: hub id, dir or `tiny`
    processor: str = Field(default="laion/CLIP-ViT-H-14-laion2B-s32B-b79K", min_length=1)  # CLIPProcessor or `tiny`
    batch_size: int | None = Field(default=None, ge=1)


class ImageRewardKeys(Keys):
    name: Literal["imagereward"]
    checkpoint: str | None = None     # ImageReward.pt (THUDM/ImageReward) or `tiny`; required
    med_config: str | None = None     # its med_config.json (null: the one beside checkpoint) or `tiny`
    tokenizer: str = Field(default="bert-base-uncased", min_length=1)  # BertTokenizer: hub id, local dir or `tiny`
    batch_size: int | None = Field(default=None, ge=1)  # images per forward pass, the last padded (null: the batch)


class HPSv2Keys(Keys):
    name: Literal["hpsv2"]
    version: Literal["v2.1", "v2.0"] = "v2.1"    # which release: HPS_v2.1_compressed.pt or HPS_v2_compressed.pt
    # the checkpoint file; null: the version's file in the Hugging Face cache (hf download xswu/HPSv2 FILE); `tiny`
    checkpoint: str | None = None
    architecture: str = Field(default="ViT-H-14", min_length=1)  # open_clip architecture, a config JSON, or `tiny`
    tokenizer: str = Field(default="laion/CLIP-ViT-H-14-laion2B-s32B-b79K", min_length=1)  # CLIPTokenizer or `tiny`
    batch_size: int | None = Field(default=None, ge=1)  # images per forward pass, every pass this size (null: all)


class ClipFeaturesKeys(Keys):
    name: Literal["clip_features"]
    clip_model: str = Field(default="openai/clip-vit-large-patch14", min_length=1)  # hub id, local dir or `tiny`
    batch_size: int | None = Field(default=None, ge=1)  # images per forward pass (null: the whole batch)


class RemoteKeys(Keys):
    name: Literal["remote"]
    url: str                                           # http(s)://HOST:PORT/PATH (checked below)
    timeout_s: float = Field(default=30.0, gt=0)
    retries: int = Field(default=3, ge=0, le=20)
    backoff_s: float = Field(default=0.5, ge=0)
    batch_size: int = Field(default=16, ge=1)
    image_format: Literal["png", "raw"] = "png"
    headers: dict[str, str] | None = None


class VlmJudgeKeys(Keys):
    """A VLM judge behind an OpenAI-compatible chat endpoint (ddpo_tpu/rewards/vlm_judge.py; serving: docs/rewards.md
    'VLM judges'). null: the preset's value."""

    name: Literal["vlm_judge"]
    url: str                                           # the API base, http(s)://HOST:PORT/v1 (checked below)
    preset: Literal["unifiedreward_v1_5", "unifiedreward_v2", "yes_no"] = "unifiedreward_v1_5"
    model: str | None = Field(default=None, min_length=1)  # the served model name (vLLM: --served-model-name)
    timeout_s: float = Field(default=120.0, gt=0)      # per request (connect and each read)
    retries: int = Field(default=3, ge=0, le=20)       # connection errors, timeouts, 5xx and 429
    backoff_s: float = Field(default=1.0, ge=0)        # first wait; doubles each retry
    max_concurrency: int = Field(default=16, ge=1, le=1024)  # requests in flight (one image each)
    temperature: float | None = Field(default=None, ge=0, le=2)
    max_tokens: int | None = Field(default=None, ge=1)  # the reply's token limit
    api_key_env: str | None = None                     # NAME of the environment variable holding the API key
    image_format: Literal["png", "jpeg"] | None = None
    image_size: int | None = Field(default=None, ge=0, le=4096)  # resize to a square first; 0: as generated
    prompt_template: str | None = Field(default=None, min_length=1)  # the question; {prompt}: the image's prompt
    top_logprobs: int = Field(default=20, ge=1, le=20)  # yes_no: how many first-token alternatives to read
    canonicalize: bool = False                         # yes_no: sum every case/space variant of Yes and No
    unparsed: Literal["zero", "nan"] = "zero"          # a reply with no score: 0 as the references, or NaN


class DigitClassifierKeys(Keys):
    name: Literal["digit_classifier"]
    target: int | None = Field(default=7, ge=0, le=9)  # P(this digit); null: P(the digit the prompt names)
    cache_dir: str = Field(default="~/.cache/ddpo_tpu/models", min_length=1)  # where its classifier is built once


class OcrKeys(Keys):
    name: Literal["ocr"]
    # paddle (the reference's PaddleOCR 2.x, an optional extra), easyocr, a registered name (vlm), or module:function
    # (a function (list of uint8 HxWx3 RGB images) -> list[str]); ddpo_tpu/rewards/ocr.py
    recognizer: str = Field(default="paddle", min_length=1)
    use_gpu: bool = False  # paddle / easyocr on the GPU (the reference's OcrScorer() default: False)
    # recognizer=vlm (verl-omni's GenRM-OCR through a chat endpoint, rewards/vlm_judge.py VlmTranscriber): the API
    # base http(s)://HOST:PORT/v1, the served model (null: Qwen/Qwen2.5-VL-7B-Instruct), the NAME of the environment
    # variable holding an API key, the per-request timeout and the requests in flight
    url: str | None = None
    model: str | None = Field(default=None, min_length=1)
    api_key_env: str | None = None
    timeout_s: float = Field(default=120.0, gt=0)
    max_concurrency: int = Field(default=16, ge=1, le=1024)


class GenevalKeys(Keys):
    name: Literal["geneval"]
    # mmdet (the reference's Mask2Former Swin-S, mmdet 2.x: its own environment), transformers (an in-process
    # approximation), or module:function (images -> per image {class: [(box xyxy, score, mask or None), ...]})
    detector: str = Field(default="mmdet", min_length=1)
    # mmdet: the checkpoint .pth (required); transformers: a Mask2Former/DETR hub id or dir (null: Mask2Former Swin-S
    # COCO instance, facebook/mask2former-swin-small-coco-instance), or `tiny` (rewards/tiny_mask2former.py)
    detector_model: str | None = None
    detector_config: str | None = None  # mmdet only: the config .py (null: mmdet's own Mask2Former Swin-S COCO config)
    # colour classifier: open_clip (the reference's open_clip ViT-L-14 `openai`), clip (the same weights through
    # transformers' CLIPModel: clip_model), or module:function ((crops, classname) -> colour names)
    colors: str = Field(default="open_clip", min_length=1)
    clip_model: str = Field(default="openai/clip-vit-large-patch14", min_length=1)  # colors=clip: hub id, dir or `tiny`
    lenient_accuracy: bool = False  # also log geneval/accuracy (the reference's `evaluate`: >= counts, exclude clauses)


REWARDS.register(RewardSpec("jpeg_compressibility", "smaller JPEG files", JpegCompressibilityKeys,
                            "ddpo_tpu.rewards.jpeg"))
REWARDS.register(RewardSpec("jpeg_incompressibility", "larger JPEG files", JpegIncompressibilityKeys,
                            "ddpo_tpu.rewards.jpeg"))
REWARDS.register(RewardSpec("aesthetic", "LAION aesthetic predictor on CLIP ViT-L/14", AestheticKeys,
                            "ddpo_tpu.rewards.aesthetic", torch=True, problems=_aesthetic_problems))
REWARDS.register(RewardSpec("clip_score", "CLIP image-text similarity", ClipScoreKeys, "ddpo_tpu.rewards.clip_score",
                            torch=True))
REWARDS.register(RewardSpec("frame_consistency", "frame-to-frame consistency of CLIP image features (videos)",
                            FrameConsistencyKeys, "ddpo_tpu.rewards.frame_consistency", torch=True, takes="videos"))
REWARDS.register(RewardSpec("pickscore", "PickScore preference model", PickScoreKeys, "ddpo_tpu.rewards.pickscore",
                            torch=True, problems=_tiny_pair("clip_model", "processor")))
REWARDS.register(RewardSpec("imagereward", "ImageReward v1.0 preference model (BLIP)", ImageRewardKeys,
                            "ddpo_tpu.rewards.imagereward", torch=True, problems=_imagereward_problems))
REWARDS.register(RewardSpec("hpsv2", "HPSv2 human preference score (open_clip ViT-H/14, a cosine)", HPSv2Keys,
                            "ddpo_tpu.rewards.hpsv2", torch=True, problems=_hpsv2_problems))
# GARDO's feature model (its code: DINOv3), for algorithm.diversity_features; CLIP's image embedding stands in
REWARDS.register(RewardSpec("clip_features", "CLIP image features (a feature model, not a score)", ClipFeaturesKeys,
                            "ddpo_tpu.rewards.clip_features", torch=True, features=True))
REWARDS.register(RewardSpec("remote", "a reward server over HTTP", RemoteKeys, "ddpo_tpu.rewards.remote",
                            problems=lambda r, prefix: url_problems(f"{prefix}.url", r.url)))
REWARDS.register(RewardSpec("digit_classifier", "P(digit) of a small MNIST classifier (the digits demo)",
                            DigitClassifierKeys, "ddpo_tpu.rewards.digits", prompt_problems=_prompted_digit_problems))
REWARDS.register(RewardSpec("ocr", "text between the prompt's quotes read back by OCR (Flow-GRPO)", OcrKeys,
                            "ddpo_tpu.rewards.ocr", problems=_ocr_problems, prompt_problems=_ocr_prompt_problems))
REWARDS.register(RewardSpec("geneval", "GenEval object, count, colour and position rules on detections",
                            GenevalKeys, "ddpo_tpu.rewards.geneval", torch=True, problems=_geneval_problems,
                            source_problems=_geneval_source_problems))
REWARDS.register(RewardSpec("vlm_judge", "a VLM judge over an OpenAI-compatible chat endpoint (vLLM, sglang)",
                            VlmJudgeKeys, "ddpo_tpu.rewards.vlm_judge", problems=_vlm_judge_problems))
# reward=weighted: a weighted sum of the others; its keys are built by the schema from the components above
REWARDS.register(RewardSpec("weighted", "a weighted sum of rewards", Keys, "ddpo_tpu.rewards.weighted",
                            composite=True))
