"""Each reward's config keys: a pydantic model per reward (the reward constructor's keyword arguments), strict and
frozen. catalog/rewards.py registers them with their modules and checks; catalog/reward_checks.py reads them. Only
pydantic: the schema builds the `reward` group from these."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Keys(BaseModel):
    # strict: "4" is not an int and 1.5 is not an int; ints are accepted where floats are expected.
    # no inf/nan: Hydra parses `inf` and `nan` as floats, and no key of a run means either
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)



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
