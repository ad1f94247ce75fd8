"""Rewards: each one's config keys (a pydantic model: the reward constructor's keyword arguments), the module that
registers its torch/numpy implementation, and what the schema cannot say about its keys. The schema builds the
`reward` group (and reward=weighted's components) from this registry, so a reward is known by registering it here.
Adding a reward: its keys class (catalog/reward_keys.py) and spec here, its module (a `@register_reward` constructor,
ddpo_tpu/rewards) and conf/reward/<name>.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import Field

from ddpo_tpu.catalog.registry import Registry
from ddpo_tpu.catalog.reward_keys import (  # noqa: F401 -- re-exported: callers import the key classes from here
    FRAME_REDUCTIONS, Keys, FrameReductionKeys, _JpegKeys, JpegCompressibilityKeys, JpegIncompressibilityKeys,
    AestheticKeys, ClipScoreKeys, FrameConsistencyKeys, PickScoreKeys, ImageRewardKeys, HPSv2Keys,
    ClipFeaturesKeys, RemoteKeys, VlmJudgeKeys, DigitClassifierKeys, OcrKeys, GenevalKeys)
from ddpo_tpu.catalog.reward_checks import (  # noqa: F401 -- re-exported: callers import them from here
    TINY, PROMPTED_DIGIT, OPTIONAL_BACKENDS, backend_problems, OCR_RECOGNIZERS, GENEVAL_DETECTORS, GENEVAL_COLORS,
    quoted_text, url_problems, IMAGEREWARD_FILES, HPSV2_FILES, _tiny_pair, _aesthetic_problems,
    _imagereward_problems, _hpsv2_problems, _ocr_problems, _ocr_prompt_problems, _geneval_problems,
    _geneval_source_problems, _vlm_judge_problems, _prompted_digit_problems, _in_own_process, _hf_cached,
    _geneval_row_problem, _sources_problems)
from ddpo_tpu.problems import Problem


class EditConsistencyKeys(Keys):
    """rewards/edit_consistency.py: closeness to the source picture + color_weight x the colour the prompt names."""

    name: Literal["edit_consistency"]
    color_weight: float = Field(default=0.5, ge=0.0)
    grid: int = Field(default=2, ge=0, le=64)  # blocks a side of the coarse colour layout compared (0: every pixel)


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
    # scores each output against its prompt's source pictures (the edit task: metadata["source_images"], rewards/
    # base.py): refused on prompts without them; an edit family needs its reward (or a component) to take them
    takes_sources: bool = False


REWARDS: Registry[RewardSpec] = Registry("reward")


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
REWARDS.register(RewardSpec("edit_consistency", "closeness to the edit's source picture + the colour the prompt asks",
                            EditConsistencyKeys, "ddpo_tpu.rewards.edit_consistency", takes_sources=True,
                            source_problems=_sources_problems))
# reward=weighted: a weighted sum of the others; its keys are built by the schema from the components above
REWARDS.register(RewardSpec("weighted", "a weighted sum of rewards", Keys, "ddpo_tpu.rewards.weighted",
                            composite=True))
