"""VLM judges: rewards read from a vision-language model served behind an OpenAI-compatible chat endpoint.

``reward=vlm_judge`` sends one chat request per image (the image as a base64 data URL and the preset's question with
the image's prompt), parses the reply and scales it to [0, 1]. The presets are the references' judges, request for
request:

* ``unifiedreward_v1_5``: UnifiedReward 1.5 as flow_grpo rewards with it (yifan123/flow_grpo@ac4c86e
  flow_grpo/rewards.py:284-357, ``unifiedreward_score_sglang``): the image resized to 512 x 512 (PIL's default
  bicubic), a PNG data URL ``data:image;base64,...``, the "<image>\\nYou are given a text caption ..." question with
  ``Text Caption: [prompt]``, ``temperature=0`` and the server's default token limit; the score is the first
  ``Final Score: x`` with x a digit 1-5 and an optional decimal part (rewards.py:300), divided by 5.
* ``unifiedreward_v2``: UnifiedReward 2.0's three axes as verl-omni scores them (verl-project/verl-omni@a1139ba
  verl_omni/utils/reward_score/unified_reward.py:30-165): the image as is, ``data:image/png;base64,...``, the
  point-score question (:78-95), ``temperature=0.0, top_p=1.0, max_tokens=512``; the reply's ``Alignment`` /
  ``Coherence`` / ``Style Score (1-5): x`` values (the last of each name, case-insensitive; when none is found, the
  reply's first three numbers, :98-116), their mean clipped to [1, 5] and mapped to (mean - 1) / 4 (:119-126). The
  axes are logged as extras.
* ``yes_no``: a Yes/No judge read from logprobs as Flow-Factory's ``vllm_evaluate`` (X-GenGroup/Flow-Factory@a0b2bc5
  src/flow_factory/rewards/vllm_evaluate.py:63-108, 144-157, 247-295): a JPEG data URL (PIL's default quality),
  the image-quality question (it does not include the prompt; ``prompt_template`` can), ``temperature=0.0,
  max_completion_tokens=1, logprobs=true, top_logprobs=20``; the reward is sigmoid(logprob("Yes") - logprob("No"))
  over the first token's top logprobs (-inf for one missing), i.e. P(Yes) / (P(Yes) + P(No)); with ``canonicalize``
  the probabilities of every token that strips and lower-cases to "yes" / "no" are summed first.

A reply that cannot be parsed (no score, no logprobs, neither Yes nor No among them): every reference scores it 0.0
and carries on (flow_grpo rewards.py:298-310, verl-omni unified_reward.py:121-122, Flow-Factory vllm_evaluate.py:76,
80, 90, 108). ``unparsed=zero`` (the default) does the same; ``unparsed=nan`` makes it a NaN reward for the trainer's
``on_nonfinite_reward`` to handle. Either way the extra ``unparsed`` (1 for such an image) logs how often it happens,
so a judge that has drifted off its format shows up in the epoch's metrics instead of as a silent zero.

Where this differs from the references, on purpose: a request that keeps failing raises after ``retries`` (as
rewards/remote.py) instead of scoring 0.0 (Flow-Factory vllm_evaluate.py:285-295) or retrying 1000 times; there is no
per-image score cache (Flow-Factory's keys on the image bytes; generated images rarely repeat).

``VlmTranscriber`` is the VLM OCR recogniser of verl-omni's GenRM-OCR (verl_omni/utils/reward_score/genrm_ocr.py:34-38,
174-195): a system "You are a helpful assistant." message, the image as a PNG data URL and the "Please output only the
text content ..." instruction, ``temperature=0.7, top_p=0.8, max_tokens=4096``; the transcription is the reply's text,
unchanged (the OCR reward normalises it). It is a plain ``(list of uint8 (H, W, 3) images) -> list[str]`` callable.
"""

from __future__ import annotations

import base64
import io
import math
import re
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, RewardScores, register_reward
from ddpo_tpu.rewards.chat import ChatClient

__all__ = ["PRESETS", "Preset", "VlmJudge", "VlmTranscriber", "image_data_url", "parse_final_score",
           "parse_unified_reward_v2", "score_unified_reward_v2", "yes_probability", "reply_text"]

_NAME = "vlm_judge"
IMAGE_FORMATS = ("png", "jpeg")
UNPARSED = ("zero", "nan")

# --- the references' questions, verbatim (the judges were trained on them) --------------------------------------------

# flow_grpo@ac4c86e flow_grpo/rewards.py:315
UNIFIEDREWARD_V1_5_TEMPLATE = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate this "
    "image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the "
    "provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in "
    "the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, assign a score from 1 "
    "to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
# verl-omni@a1139ba verl_omni/utils/reward_score/unified_reward.py:78-95
UNIFIEDREWARD_V2_TEMPLATE = (
    "You are presented with a generated image and its associated text caption. Your task is to analyze the image "
    "across multiple dimensions in relation to the caption. Specifically:\n"
    "Provide overall assessments for the image along the following axes (each rated from 1 to 5):\n"
    "- Alignment Score: How well the image matches the caption in terms of content.\n"
    "- Coherence Score: How logically consistent the image is (absence of visual glitches, object distortions, etc.).\n"
    "- Style Score: How aesthetically appealing the image looks, regardless of caption accuracy.\n\n"
    "Output your evaluation using the format below:\n\n"
    "Alignment Score (1-5): X\nCoherence Score (1-5): Y\nStyle Score (1-5): Z\n\n"
    "Your task is provided as follows:\nText Caption: [{prompt}]"
)
# Flow-Factory@a0b2bc5 src/flow_factory/rewards/vllm_evaluate.py:144-157 (no {prompt}: it judges the image alone)
YES_NO_TEMPLATE = (
    "You are an expert image quality assessor. Evaluate this AI-generated image by considering ALL of the following "
    "criteria:\n1. Naturalness: Does the scene look realistic with correct perspective, shadows, and lighting?\n"
    "2. Artifacts: Is the image free from distortions, blurriness, watermarks, deformed faces, unusual body parts, or "
    "unharmonized subjects?\n3. Aesthetic Appeal: Does the image exhibit pleasing composition, color harmony, and "
    "visual balance?\n4. Detail & Clarity: Are textures, edges, and fine details rendered sharply and coherently "
    "without noise or smearing?\n5. Overall Coherence: Is the image semantically consistent, with all elements "
    "logically fitting together in a unified scene?\n\nConsidering all the above criteria holistically, is this a "
    "high-quality image? Answer Yes or No."
)
# verl-omni@a1139ba verl_omni/utils/reward_score/genrm_ocr.py:34-36, 176
OCR_SYSTEM = "You are a helpful assistant."
OCR_INSTRUCTION = ("Please output only the text content from the image without any additional descriptions or "
                   "formatting.")


# --- parsers: each returns None for a reply it cannot read ------------------------------------------------------------

_FINAL_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")  # flow_grpo rewards.py:300: one digit 1-5, decimals
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_AXIS = re.compile(rf"(Alignment|Coherence|Style)\s+Score\s*(?:\(1-5\))?\s*:\s*({_NUMBER})", re.IGNORECASE)
V2_AXES = ("alignment", "coherence", "style")


def reply_text(reply: Mapping[str, Any]) -> str:
    """The text of a chat completion's first choice ('' when the server sent none)."""
    content = reply["choices"][0]["message"].get("content")
    return content if isinstance(content, str) else ""


def parse_final_score(text: str) -> float | None:
    """UnifiedReward 1.5: the first 'Final Score: x' (x in 1-5, as the reference's pattern) on the 1-5 scale."""
    match = _FINAL_SCORE.search(text)
    return float(match.group(1)) if match else None


def parse_unified_reward_v2(text: str) -> dict[str, float]:
    """UnifiedReward 2.0's axes (1-5) by lower-case name; the first three numbers when no axis is named; {} when
    fewer than three numbers either."""
    axes = {m.group(1).lower(): float(m.group(2)) for m in _AXIS.finditer(text)}  # a repeated axis: its last value
    if axes:
        return axes
    numbers = re.findall(_NUMBER, text)
    return dict(zip(V2_AXES, map(float, numbers[:3]))) if len(numbers) >= 3 else {}


def score_unified_reward_v2(axes: Mapping[str, float]) -> float | None:
    """The axes' mean, clipped to [1, 5], mapped to [0, 1]; None without axes."""
    if not axes:
        return None
    mean = sum(axes.values()) / len(axes)
    return (min(max(mean, 1.0), 5.0) - 1.0) / 4.0


def yes_probability(reply: Mapping[str, Any], canonicalize: bool = False) -> float | None:
    """P(Yes) / (P(Yes) + P(No)) from the first generated token's top logprobs; None without logprobs or when
    neither answer is among them."""
    logprobs = reply["choices"][0].get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not content or not isinstance(content[0], Mapping):
        return None
    top = {t["token"]: float(t["logprob"]) for t in content[0].get("top_logprobs") or ()
           if isinstance(t, Mapping) and isinstance(t.get("token"), str) and _is_number(t.get("logprob"))}
    if not canonicalize:
        yes, no = top.get("Yes", -math.inf), top.get("No", -math.inf)
        if yes == -math.inf and no == -math.inf:
            return None
        return _sigmoid(yes - no)
    sums = {"yes": 0.0, "no": 0.0}
    for token, logprob in top.items():
        word = token.strip().lower()
        if word in sums:
            sums[word] += math.exp(logprob)
    total = sums["yes"] + sums["no"]
    return sums["yes"] / total if total > 0.0 else None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


# --- presets --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """One reference judge: its request and how its reply becomes a [0, 1] score (+ extras)."""

    model: str                       # the served model name the reference asks for (reward.model overrides)
    template: str                    # the user text; {prompt} is replaced by the image's prompt
    sampling: Mapping[str, Any]      # the request's sampling fields, as the reference sends them
    image_format: str                # png or jpeg
    media_type: str                  # the data URL's media type
    image_size: int                  # resize to a square of this side first; 0: as generated
    tokens_field: str | None         # which field carries the token limit (reward.max_tokens replaces it)
    score: Callable[[Mapping[str, Any], bool], tuple[float | None, dict[str, float]]] = field(repr=False)


def _score_v1_5(reply: Mapping[str, Any], canonicalize: bool) -> tuple[float | None, dict[str, float]]:
    raw = parse_final_score(reply_text(reply))
    return (None if raw is None else raw / 5.0), {"raw_score": math.nan if raw is None else raw}


def _score_v2(reply: Mapping[str, Any], canonicalize: bool) -> tuple[float | None, dict[str, float]]:
    axes = parse_unified_reward_v2(reply_text(reply))
    return score_unified_reward_v2(axes), {a: axes.get(a, math.nan) for a in V2_AXES}


def _score_yes_no(reply: Mapping[str, Any], canonicalize: bool) -> tuple[float | None, dict[str, float]]:
    return yes_probability(reply, canonicalize), {}


PRESETS: dict[str, Preset] = {
    "unifiedreward_v1_5": Preset("UnifiedReward-7b-v1.5", UNIFIEDREWARD_V1_5_TEMPLATE, {"temperature": 0},
                                 "png", "image", 512, None, _score_v1_5),
    "unifiedreward_v2": Preset("CodeGoat24/UnifiedReward-2.0-qwen3vl-2b", UNIFIEDREWARD_V2_TEMPLATE,
                               {"temperature": 0.0, "top_p": 1.0, "max_tokens": 512},
                               "png", "image/png", 0, "max_tokens", _score_v2),
    "yes_no": Preset("Qwen3-VL", YES_NO_TEMPLATE,
                     {"temperature": 0.0, "max_completion_tokens": 1, "logprobs": True, "top_logprobs": 20},
                     "jpeg", "image/jpeg", 0, "max_completion_tokens", _score_yes_no),
}


def image_data_url(image: np.ndarray, image_format: str = "png", media_type: str | None = None,
                   size: int = 0) -> str:
    """A uint8 (H, W, 3) image as a base64 data URL (lossless PNG, or JPEG at PIL's default quality 75 as
    Flow-Factory sends), resized first to a size x size square (PIL's default bicubic, as flow_grpo) when size > 0."""
    from PIL import Image

    pil = Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8), mode="RGB")
    if size:
        pil = pil.resize((size, size), Image.BICUBIC)
    buffer = io.BytesIO()
    if image_format == "png":  # the fastest zlib level: the same pixels reach the judge, in a fraction of the time
        pil.save(buffer, format="PNG", compress_level=1)
    else:
        pil.save(buffer, format="JPEG")
    media_type = media_type or f"image/{image_format}"
    return f"data:{media_type};base64,{base64.b64encode(buffer.getvalue()).decode('ascii')}"


def _user_message(url: str, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


# --- the reward -----------------------------------------------------------------------------------------------------


@register_reward(_NAME)
class VlmJudge(Reward):
    """A [0, 1] reward per image from a VLM judge served by vLLM or sglang (see the module docstring).

    Args:
        url: the API base, ``http(s)://HOST:PORT/v1``.
        preset: ``unifiedreward_v1_5``, ``unifiedreward_v2`` or ``yes_no``.
        model: the served model name (null: the preset's).
        timeout_s, retries, backoff_s, max_concurrency, api_key_env: the client's (rewards/chat.py).
        temperature, max_tokens: override the preset's (null: the preset's).
        image_format, image_size: override the preset's (``png``/``jpeg``; a square side, 0: as generated).
        prompt_template: the question, ``{prompt}`` replaced by the image's prompt (null: the preset's).
        top_logprobs, canonicalize: the yes_no judge's.
        unparsed: ``zero`` (as the references) or ``nan`` for a reply that cannot be parsed.
    """

    name = _NAME

    def __init__(self, url: str, preset: str = "unifiedreward_v1_5", model: str | None = None,
                 timeout_s: float = 120.0, retries: int = 3, backoff_s: float = 1.0, max_concurrency: int = 16,
                 temperature: float | None = None, max_tokens: int | None = None, api_key_env: str | None = None,
                 image_format: str | None = None, image_size: int | None = None, prompt_template: str | None = None,
                 top_logprobs: int = 20, canonicalize: bool = False, unparsed: str = "zero"):
        if preset not in PRESETS:
            raise self._error(f"reward.preset={preset!r}: must be one of {sorted(PRESETS)}")
        if image_format is not None and image_format not in IMAGE_FORMATS:
            raise self._error(f"reward.image_format={image_format!r}: must be one of {list(IMAGE_FORMATS)} or null")
        if unparsed not in UNPARSED:
            raise self._error(f"reward.unparsed={unparsed!r}: must be one of {list(UNPARSED)}")
        self.preset_name, self.preset = preset, PRESETS[preset]
        self.client = ChatClient(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                                 max_concurrency=max_concurrency, api_key_env=api_key_env, error=self._error,
                                 should_stop=lambda: self.should_stop())
        self.model = model or self.preset.model
        self.template = self.preset.template if prompt_template is None else prompt_template
        self.image_format = image_format or self.preset.image_format
        # the preset's media type goes with its own format (flow_grpo's bare "image"); another format names its own
        self.media_type = self.preset.media_type if self.image_format == self.preset.image_format else None
        self.image_size = self.preset.image_size if image_size is None else int(image_size)
        sampling = dict(self.preset.sampling)
        if temperature is not None:
            sampling["temperature"] = float(temperature)
        if max_tokens is not None:
            sampling.pop(self.preset.tokens_field or "max_tokens", None)
            sampling[self.preset.tokens_field or "max_tokens"] = int(max_tokens)
        if "top_logprobs" in sampling:
            sampling["top_logprobs"] = int(top_logprobs)
        self.sampling, self.canonicalize, self.unparsed = sampling, bool(canonicalize), unparsed

    # set by the trainer (rewards/from_config.py): a SIGTERM abandons the waiting requests within ~0.2 s
    should_stop = staticmethod(lambda: False)

    def request(self, image: np.ndarray, prompt: str) -> dict[str, Any]:
        """The chat-completion body for one image and its prompt."""
        url = image_data_url(image, self.image_format, self.media_type, self.image_size)
        return {"model": self.model, "messages": [_user_message(url, self.template.replace("{prompt}", prompt))],
                **self.sampling}

    def score(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
        images = self._check_host_images(images, prompts)
        # the bodies are built on the client's threads: encoding overlaps the requests already in flight
        replies = self.client.complete([partial(self.request, img, str(p)) for img, p in zip(images, prompts)])
        n = len(replies)
        values = np.empty(n, dtype=np.float32)
        unparsed = np.zeros(n, dtype=np.float32)
        extras: dict[str, np.ndarray] = {}
        for i, reply in enumerate(replies):
            value, more = self.preset.score(reply, self.canonicalize)
            if value is None:
                unparsed[i] = 1.0
                value = 0.0 if self.unparsed == "zero" else math.nan
            values[i] = value
            for k, v in more.items():
                extras.setdefault(k, np.full(n, np.nan, dtype=np.float32))[i] = v
        return RewardScores(values, {**extras, "unparsed": unparsed})

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self.score(images, prompts, metadata).values

    def __repr__(self) -> str:
        return (f"VlmJudge(url={self.client.shown_url!r}, preset={self.preset_name!r}, model={self.model!r}, "
                f"max_concurrency={self.client.max_concurrency})")


class VlmTranscriber:
    """A VLM as an OCR recogniser, as verl-omni's GenRM-OCR asks it: ``(list of uint8 (H, W, 3) images) ->
    list[str]``, one transcription per image (the reply's text, unchanged; '' for an empty reply).

    Args: url, model (the served name), the client's keys (rewards/chat.py), and the sampling fields (verl-omni's
    defaults). ``prefix`` names the keys in messages (e.g. ``reward.recognizer``), ``reward_name`` the reward in
    its errors (RewardError)."""

    def __init__(self, url: str, model: str = "Qwen/Qwen2.5-VL-7B-Instruct", *, timeout_s: float = 120.0,
                 retries: int = 3, backoff_s: float = 1.0, max_concurrency: int = 16, api_key_env: str | None = None,
                 temperature: float = 0.7, top_p: float = 0.8, max_tokens: int = 4096, image_format: str = "png",
                 prefix: str = "reward", reward_name: str = "ocr"):
        from ddpo_tpu.rewards.base import RewardError

        if image_format not in IMAGE_FORMATS:
            raise RewardError(reward_name, f"{prefix}.image_format={image_format!r}: must be one of "
                              f"{list(IMAGE_FORMATS)}")
        self.client = ChatClient(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                                 max_concurrency=max_concurrency, api_key_env=api_key_env,
                                 error=lambda message: RewardError(reward_name, message),
                                 should_stop=lambda: self.should_stop(), prefix=prefix)
        self.model, self.image_format = model, image_format
        self.sampling = {"temperature": float(temperature), "top_p": float(top_p), "max_tokens": int(max_tokens)}

    should_stop = staticmethod(lambda: False)

    def request(self, image: np.ndarray) -> dict[str, Any]:
        url = image_data_url(image, self.image_format)
        return {"model": self.model, "messages": [{"role": "system", "content": OCR_SYSTEM},
                                                  _user_message(url, OCR_INSTRUCTION)], **self.sampling}

    def __call__(self, images: Sequence[np.ndarray]) -> list[str]:
        return [reply_text(r) for r in self.client.complete([partial(self.request, np.asarray(i)) for i in images])]
