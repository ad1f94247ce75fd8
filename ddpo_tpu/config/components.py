"""Rules of the registered components: the model family (its sampler, local builds, the keys only it reads, the
checkpoint folders a local model must hold), the algorithm (its own rules, from the catalog), the reward (what the
schema cannot say about its keys) and guidance at train time. Every fact about a component is read from its spec in
ddpo_tpu/catalog/."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddpo_tpu.catalog import ALGORITHMS, FAMILIES, REWARDS, SAMPLERS, family
from ddpo_tpu.catalog.families import family_of_builder, models_making
from ddpo_tpu.catalog.samplers import sampler_keys
from ddpo_tpu.config.batch import Totals
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.problems import Fix, Problem


def family_problems(cfg: RunConfig) -> list[Problem]:
    problems: list[Problem] = []
    m, s = cfg.model, cfg.sample
    spec = family(m.family)
    if s.name != spec.sampler:
        problems.append(Problem("sample.name", s.name, f"model.family={m.family} samples with {spec.sampler}",
                                Fix.of({"sampler": SAMPLERS.get(spec.sampler).group}, verb="use",
                                       note=f"(or another {spec.sampler} sampler)")))
    else:
        needed = SAMPLERS.get(spec.sampler).keys
        for key in needed:
            if getattr(s, key) is None:
                problems.append(Problem(f"sample.{key}", None, f"the {s.name} sampler needs it",
                                        f"set sample.{key}=... (see conf/sampler/)"))
        for key in sampler_keys():
            if key not in needed and getattr(s, key) is not None:
                problems.append(Problem(f"sample.{key}", getattr(s, key), f"the {s.name} sampler does not read it",
                                        Fix.of({f"sample.{key}": None})))
    problems.extend(window_problems(cfg))
    if (m.builder is None) == (m.pretrained is None):
        problems.append(Problem("model.pretrained", m.pretrained,
                                "set exactly one of model.pretrained (hub id or local dir) and model.builder",
                                "e.g. model=tiny for the local test model, model=sd14 for Stable Diffusion 1.4"))
    elif m.pretrained is not None:
        problems.extend(pretrained_problems(m.pretrained, m.family))
    if m.builder is not None and m.builder not in spec.builders:
        other = family_of_builder(m.builder)
        assert other is not None  # the schema takes only the catalog's builders (schema.py _builder)
        problems.append(Problem("model.builder", m.builder, f"a model.family={other.name} build, not {m.family}",
                                f"set model.family={other.name}, or use model={spec.builders[0]}" if spec.builders
                                else f"set model.family={other.name}"))
    for key, unused in _others_keys(m.family).items():
        if getattr(m, key) != unused:
            owners = [f.name for f in FAMILIES if key in f.own_keys]
            problems.append(Problem(f"model.{key}", getattr(m, key), f"only the {', '.join(owners)} family reads it",
                                    Fix.of({f"model.{key}": unused})))
    if m.resolution is not None:
        if spec.resolution_multiple is None:
            problems.append(Problem("model.resolution", m.resolution, f"the {m.family} family samples at its model's "
                                    "own size and does not read it", Fix.of({"model.resolution": None})))
        elif m.resolution % spec.resolution_multiple:
            r = spec.resolution_multiple
            near = max(r, round(m.resolution / r) * r)
            problems.append(Problem("model.resolution", m.resolution, f"the {m.family} family's image sizes are "
                                    f"multiples of {r} pixels", Fix.of({"model.resolution": near}, verb="try")))
    problems.extend(frame_problems(m, spec))
    if m.dtype == "bfloat16" and cfg.train.mixed_precision != "bf16":
        problems.append(Problem("model.dtype", m.dtype, "bfloat16 weights need bfloat16 compute",
                                Fix.of({"train.mixed_precision": "bf16"}, {"model.dtype": "float32"})))
    return problems


def frame_problems(m, spec) -> list[Problem]:
    """A video family's model.num_frames: set, and 1 + a multiple of its VAE's temporal compression (image families
    refuse the key through own_keys)."""
    n, step = m.num_frames, spec.frame_step
    if step is None:
        return []
    if n is None:
        return [Problem("model.num_frames", None, f"the {m.family} family samples videos and needs their length",
                        Fix.of({"model.num_frames": 8 * step + 1}, verb="try"))]
    if (n - 1) % step:
        lower = (n - 1) // step * step + 1
        return [Problem("model.num_frames", n, f"the {m.family} VAE compresses each {step} frames after the first "
                        f"into one latent frame: a video has {step}k + 1 frames",
                        Fix.of({"model.num_frames": lower}, {"model.num_frames": lower + step}, verb="try"))]
    return []


def window_problems(cfg: RunConfig) -> list[Problem]:
    """An SDE window needs a sampler that has one, and must fit inside its range and the steps."""
    s = cfg.sample
    w, T = s.sde_window, s.num_steps
    if w.size is None:
        return []
    if not SAMPLERS.get(s.name).windows:
        able = [x.group for x in SAMPLERS if x.windows]
        return [Problem("sample.sde_window.size", w.size, f"the {s.name} sampler has no SDE window",
                        Fix.of({"sample.sde_window.size": None}, note=f"(windows: sampler={', '.join(able)})"))]
    lo, hi = w.range if w.range is not None else (0, T)
    if w.range is not None and not lo < hi <= T:
        return [Problem("sample.sde_window.range", w.range, f"[lo, hi) must satisfy lo < hi <= {T} "
                        f"(sample.num_steps)", Fix.of({"sample.sde_window.range": [0, T]}, verb="try"))]
    if w.size > hi - lo:
        return [Problem("sample.sde_window.size", w.size, f"larger than the {hi - lo} steps it may cover "
                        f"([{lo}, {hi}))", Fix.of({"sample.sde_window.size": hi - lo}, note="or fewer"))]
    if w.placement in ("fixed", "sliding") and not lo <= w.start <= hi - w.size:
        return [Problem("sample.sde_window.start", w.start, f"a window of {w.size} starting there leaves "
                        f"[{lo}, {hi})", Fix.of({"sample.sde_window.start": lo}, verb="try"))]
    return []


def _others_keys(name: str) -> dict[str, Any]:
    """Model keys other families own (with their unused value) that this family does not read."""
    own = family(name).own_keys
    return {k: v for f in FAMILIES if f.name != name for k, v in f.own_keys.items() if k not in own}


def pretrained_problems(pretrained: str, family_name: str) -> list[Problem]:
    """A local model dir must have what the family's loader loads; a hub id is checked when it is loaded."""
    spec = family(family_name)
    path = Path(pretrained).expanduser()
    fix = (f"point model.pretrained at a diffusers checkpoint dir, as `huggingface-cli download "
           f"{spec.example_hub_id} --local-dir DIR` writes, or use a hub id")
    if path.is_dir():
        missing = [f"{s}/" for s in spec.subfolders if not (path / s).is_dir()]
        if missing:
            return [Problem("model.pretrained", pretrained,
                            f"not a diffusers {spec.title} checkpoint: missing {', '.join(missing)}", fix)]
    elif path.exists():
        return [Problem("model.pretrained", pretrained, "a file, not a checkpoint directory", fix)]
    elif looks_like_path(pretrained):
        return [Problem("model.pretrained", pretrained, "no such directory", fix)]
    return []


def looks_like_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~")) or os.sep in s and s.count("/") > 1


def algorithm_problems(cfg: RunConfig, tot: Totals) -> list[Problem]:
    return ALGORITHMS.get(cfg.algorithm.name).problems(cfg, tot)


class _Served:
    """A component of a weighted reward that runs whole in reward.process's environment: its keys, and that process,
    so its checks leave what that environment imports to that environment (catalog/rewards.py _in_own_process)."""

    def __init__(self, keys: Any, process: Any):
        self._keys, self.process = keys, process

    def __getattr__(self, item: str) -> Any:
        return getattr(self._keys, item)


def reward_problems(r: Any, key: str = "reward") -> list[Problem]:
    """What the schema cannot say about a reward's keys (types, names and unknown keys it has checked): the run's
    reward, or each component of reward=weighted under reward.components.N."""
    if r.name == "weighted":
        served = getattr(getattr(r, "process", None), "python", None) is not None
        parts = [_Served(c, r.process) if served else c for c in r.components]
        problems = [p for i, c in enumerate(parts) for p in reward_problems(c, f"{key}.components.{i}")]
        if all(c.weight == 0 for c in r.components):
            problems.append(Problem(f"{key}.components", f"[{len(r.components)} with weight 0]",
                                    "every weight is 0: the reward is 0 for every image and nothing is learned",
                                    f"give a component a weight, e.g. {key}.components.0.weight=1"))
        return problems
    return REWARDS.get(r.name).problems(r, key)


def reward_input_problems(cfg: RunConfig) -> list[Problem]:
    """What the model decodes against what each reward takes (catalog: FamilySpec.output, RewardSpec.takes): a video
    reward cannot score images; an image reward scores a video's frames, reduced by its frame_reduction (the run's
    reward's is judged by the enablement table when set on an image family; a component's here)."""
    fam = family(cfg.model.family)
    r = cfg.reward
    leaves = [(f"reward.components.{i}", c) for i, c in enumerate(r.components)] if r.name == "weighted" \
        else [("reward", r)]
    problems: list[Problem] = []
    for key, leaf in leaves:
        takes = REWARDS.get(leaf.name).takes
        if takes == "videos" and fam.output == "images":
            image = next(x.name for x in REWARDS if x.takes == "images" and not x.composite)
            videos = f"or use a video model ({models_making('videos')})"
            fix = (Fix.of({"reward": image}, verb="use", note=f"(or another image reward), {videos}")
                   if key == "reward" else f"set {key}.name to an image reward (e.g. {image}), {videos}")
            problems.append(Problem(f"{key}.name", leaf.name, f"a video reward, and model.family={fam.name} makes "
                                    "images", fix))
        elif key != "reward" and fam.output == "images" and getattr(leaf, "frame_reduction", "mean") != "mean":
            problems.append(Problem(f"{key}.frame_reduction", leaf.frame_reduction, f"not read: model.family="
                                    f"{fam.name} makes images (it reduces a video's frames)",
                                    Fix.of({f"{key}.frame_reduction": "mean"}, note="(the default), or remove it")))
    return problems


def guidance_problems(cfg: RunConfig) -> list[Problem]:
    """Guidance at train time must match sampling's (else the ratio is off-policy from the first step), and
    train.cfg_detach_uncond needs an unconditional half at train time to detach."""
    t, s = cfg.train, cfg.sample
    problems: list[Problem] = []
    spec = family(cfg.model.family)
    if spec.guidance == "embedded":  # guidance-distilled: the scale is an input of the one pass, sampling and training
        for key, value in (("cfg", t.cfg), ("cfg_detach_uncond", t.cfg_detach_uncond)):
            if value:
                problems.append(Problem(f"train.{key}", True, f"the {cfg.model.family} family is guidance-distilled: "
                                        f"sample.guidance_scale={s.guidance_scale} is its guidance embedding's "
                                        "value, there is no unconditional pass to repeat or detach",
                                        Fix.of({f"train.{key}": False})))
        return problems
    if s.guidance_scale > 1 and not t.cfg:
        problems.append(Problem("train.cfg", False, f"sampling is guided (sample.guidance_scale={s.guidance_scale}) "
                                "but training scores the steps without guidance: the policy ratio is off-policy "
                                "from the first step", Fix.of({"train.cfg": True}, {"sample.guidance_scale": 1})))
    if t.cfg_detach_uncond and (not t.cfg or s.guidance_scale == 1):
        why = "train.cfg=false" if not t.cfg else "sample.guidance_scale=1"
        problems.append(Problem("train.cfg_detach_uncond", True, f"training has no guidance to detach ({why}: no "
                                f"unconditional half at train time)", "set train.cfg_detach_uncond=false, or "
                                "train.cfg=true with sample.guidance_scale > 1"))
    return problems
