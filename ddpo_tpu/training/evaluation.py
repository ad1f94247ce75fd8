"""The held-out evaluation (issue 39): a whole pass over the evaluation prompts (config/eval_plan.py: the items,
their seeds, the fixed-size batches), sampled with evaluation's own sampler (steps, the noise-free step, CFG scale,
batch size; the EMA weights when train.ema), scored by a panel of rewards, written to `eval/<name>/`:

  results.jsonl   one line per image: prompt, metadata, image index, seed, every reward's score and extras, image file
  summary.json    each reward's mean / std / min / max over the images, each extra's mean where it applies
  grid.png        the first 16 images with a caption file (grid.json: prompt and scores)
  images/         every image, NNNNN.png in results.jsonl's order

summary.json is written last: an evaluation whose summary exists is finished (a resumed run does not redo it).

Sharding: each global batch is split over the processes as sampling splits its batches (rt.local_rows); every
process scores its own rows, the scores and images are gathered, and the padding of the last batch is dropped
(eval_plan.py). The noise of each row comes from that row's own generator, so a prompt's image does not depend on
the process count or the batch it lands in (tests/e2e/test_evaluation_e2e.py compares 1 and 2 processes).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import torch

from ddpo_tpu.config.eval_plan import EvalItem, EvalPlan, make_plan
from ddpo_tpu.waits import REWARD, waiting

PREFIX_SEP = "/"


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def panel_labels(names: list[str]) -> list[str]:
    """Each panel reward's label: its name, and name_2, name_3, ... for a name listed again."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return out


def extra_name(label: str, name: str, panel_size: int) -> str:
    """An extra's name in the outputs: as the reward names it with one reward (as the epoch record names the training
    reward's), `<reward>/<extra>` in a panel of several."""
    return name if panel_size == 1 else f"{label}{PREFIX_SEP}{name}"


def summarise(scores: dict[str, np.ndarray], extras: dict[str, dict[str, np.ndarray]],
              tags: list | None = None) -> dict:
    """summary.json's numbers: per reward mean, std, min, max and n over its finite scores; per extra its mean over
    the images it applies to (finite: NaN = does not apply) and that count; with `tags` (each image's metadata
    `tag`: GenEval's single_object, counting, ...) each reward's mean per tag and the mean of those per-tag means,
    as GenEval's summary reports its accuracy per task and overall."""
    rewards = {}
    for label, v in scores.items():
        ok = v[np.isfinite(v)]
        rewards[label] = ({"mean": float(ok.mean()), "std": float(ok.std()), "min": float(ok.min()),
                           "max": float(ok.max()), "n": int(ok.size)} if ok.size else
                          {"mean": None, "std": None, "min": None, "max": None, "n": 0})
    ex = {}
    for label, named in extras.items():
        for k, v in named.items():
            ok = v[np.isfinite(v)]
            ex[extra_name(label, k, len(scores))] = {"mean": float(ok.mean()) if ok.size else None, "n": int(ok.size)}
    out = {"rewards": rewards, "extras": ex}
    if tags is not None and any(isinstance(t, str) for t in tags):
        by_tag: dict[str, dict[str, float | None]] = {}
        names = sorted({t for t in tags if isinstance(t, str)})
        for label, v in scores.items():
            for t in names:
                sel = np.array([x == t for x in tags]) & np.isfinite(v)
                by_tag.setdefault(t, {})[label] = float(v[sel].mean()) if sel.any() else None
        out["by_tag"] = by_tag
        out["tag_mean"] = {label: (float(np.mean(m)) if (m := [by_tag[t][label] for t in names
                                                               if by_tag[t][label] is not None]) else None)
                           for label in scores}
    return out


class Evaluator:
    """Built with the Trainer: the plan, the sampler (its own compiled step when any of its settings differs from
    sampling's), the unconditional batch and the reward panel."""

    def __init__(self, trainer):
        from ddpo_tpu.rewards.from_config import reward_from_config

        t = self.t = trainer
        cfg, rt, fam = t.cfg, t.rt, t.family
        e = cfg.evaluation
        self.per_replica = e.batch_size or cfg.sample.batch_size
        self.global_batch = self.per_replica * rt.replicas
        self.plan: EvalPlan = make_plan(cfg, self.global_batch, metadata_of=t.prompts.metadata)
        self.steps = e.num_steps or fam.num_steps
        guidance = cfg.sample.guidance_scale if e.guidance_scale is None else e.guidance_scale
        # the family reads sample.guidance_scale from its config: evaluation's CFG scale is a config of its own,
        # swapped in while evaluation samples (the step's graph is traced with it)
        self.view = (cfg if guidance == cfg.sample.guidance_scale else
                     cfg.model_copy(update={"sample": cfg.sample.model_copy(update={"guidance_scale": guidance})}))
        own = self.steps != fam.num_steps or e.deterministic or self.view is not cfg
        if own:
            autocast = lambda: rt.autocast(t.mixed)
            with self.sampler_config():
                self.step = rt.compile_step(fam.make_denoise_step(autocast, fam.schedule(self.steps),
                                                                  e.deterministic))
        else:
            self.step = t.denoise_step
        with torch.no_grad():
            neg = fam.encode([""])
            self.uncond = tuple(rt.shard_batch(c.expand(self.global_batch, *c.shape[1:]).contiguous()) for c in neg)
        # the panel: the training reward (already built) or each configured one, as the family scores it
        if e.rewards is None:  # None: the trainer's reward at call time (a test may swap it)
            self.panel = [(cfg.reward.name, None)]
        else:
            built = [fam.wrap_reward(reward_from_config(r, model_cache_dir=cfg.model.cache_dir, device=rt.device,
                                                        should_stop=lambda: t.stop.requested)) for r in e.rewards]
            self.panel = list(zip(panel_labels([r.name for r in e.rewards]), built))

    @contextlib.contextmanager
    def sampler_config(self):
        fam = self.t.family
        saved = fam.cfg
        fam.cfg = self.view
        try:
            yield
        finally:
            fam.cfg = saved

    def noise(self, items: list[EvalItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """(initial latents (B, ...), per-step noise (T, B, ...)): row r from items[r]'s own generator."""
        shape = self.t.family.latent_shape
        inits, noises = [], []
        for it in items:
            g = torch.Generator().manual_seed(it.seed)
            inits.append(torch.randn((1, *shape), generator=g))
            noises.append(torch.randn((self.steps, 1, *shape), generator=g))
        return torch.cat(inits), torch.cat(noises, dim=1)

    def run(self, epoch: int, out_dir: Path, name: str) -> dict | None:
        """Evaluate the current weights (their EMA when kept); writes `out_dir` on the main process; returns the
        metrics record (kind "eval"), or None when a stop was requested during the pass."""
        from ddpo_tpu.rewards.base import score_with
        from ddpo_tpu.training.epoch_data import gather_extras

        t, rt, plan = self.t, self.t.rt, self.plan
        labels = [label for label, _ in self.panel]
        scores: dict[str, list] = {k: [] for k in labels}
        extras: dict[str, list] = {k: [] for k in labels}
        rows = rt.local_rows(self.global_batch)
        shown, written, n_done = [], [], 0
        if rt.is_main:
            (out_dir / "images").mkdir(parents=True, exist_ok=True)
        t.family.model.eval()
        with t.state.ema_weights(), self.sampler_config():
            for b, idx in enumerate(plan.batches):
                # a stop (SIGTERM, preemption) abandons the pass: the epoch's checkpoint must not wait behind a
                # whole test split; no summary is written, so nothing half-done is recorded (every process agrees)
                if b and rt.any_process(t.stop.requested):
                    return None
                items = [plan.items[i] for i in idx]
                prompts = [it.prompt for it in items]
                _, _, images = t._sample_batch(prompts, None, evaluation=True, noise=self.noise(items),
                                               uncond=self.uncond, step=(self.step, self.steps))
                local = items[rows]
                lp, lm = [it.prompt for it in local], [it.metadata for it in local]
                real = plan.real[b]
                for label, reward in self.panel:
                    # the rank watch names a call that stops moving (ddpo_tpu/waits.py); the run's reward's bound
                    with waiting(REWARD, f"evaluation reward {label}, {len(lp)} images", bound_s=t.reward_bound_s):
                        s = score_with(t.reward if reward is None else reward, images, lp, lm)
                    scores[label].append(rt.gather_rows(np.asarray(s.values, dtype=np.float64))[:real])
                    ex = gather_extras(rt, [s])
                    extras[label].append({k: v[:real] for k, v in ex.items()})
                whole = rt.gather_rows(images)[:real] if rt.process_count > 1 else images[:real]
                if rt.is_main:
                    written += self._write_images(out_dir, whole, n_done)
                    shown.extend(whole[:max(0, 16 - len(shown))])
                n_done += real
        score_arrays = {k: np.concatenate(v) for k, v in scores.items()}
        extra_arrays = {k: {n: np.concatenate([d.get(n, np.full(len(s), np.nan)) for d, s in zip(v, scores[k])])
                            for n in sorted({n for d in v for n in d})} for k, v in extras.items()}
        summary = summarise(score_arrays, extra_arrays, [it.metadata.get("tag") for it in plan.items])
        first = labels[0]
        rec = {"kind": "eval", "epoch": epoch, "global_step": t.global_step,
               "reward_mean": summary["rewards"][first]["mean"], "reward_std": summary["rewards"][first]["std"],
               "rewards": {k: {"mean": v["mean"], "std": v["std"]} for k, v in summary["rewards"].items()},
               "num_prompts": plan.num_prompts, "num_images": plan.num_images, "dir": f"eval/{name}"}
        if any(extra_arrays.values()):
            rec["reward_extras"] = {k: v["mean"] for k, v in summary["extras"].items()}
        if plan.source == "evaluation.prompts":  # a few fixed prompts: each one's mean of the first reward
            per = {}
            for it, v in zip(plan.items, score_arrays[first]):
                per.setdefault(it.prompt, []).append(v)
            rec["per_prompt"] = {p: float(np.mean(v)) for p, v in per.items()}
        if rt.is_main:
            self._write(out_dir, rec, summary, score_arrays, extra_arrays, written, shown)
        rec["_images"] = np.stack(shown) if shown else None
        rec["_prompts"] = [it.prompt for it in plan.items[:len(shown)]]
        rec["_rewards"] = score_arrays[first][:len(shown)]
        return rec

    def _write_images(self, out_dir: Path, images: np.ndarray, start: int) -> list[str | None]:
        """Each image as images/NNNNN.png (its index in results.jsonl); a video family's samples are not written
        one by one (None)."""
        from PIL import Image

        from ddpo_tpu.rundir.files import atomic_write_bytes

        if images.ndim != 4:
            return [None] * len(images)
        names = []
        for i, img in enumerate(images):
            rel = f"images/{start + i:05d}.png"
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            atomic_write_bytes(out_dir / rel, buf.getvalue())
            names.append(rel)
        return names

    def _write(self, out_dir, rec, summary, scores, extras, files, shown) -> None:
        from ddpo_tpu.rundir.files import atomic_write_bytes, save_captioned_grid

        plan = self.plan
        lines = []
        for i, it in enumerate(plan.items):
            lines.append(json.dumps({
                "prompt": it.prompt, "metadata": it.metadata, "image_index": it.index, "seed": it.seed,
                "scores": {k: _finite(v[i]) for k, v in scores.items()},
                **({"extras": {extra_name(k, n, len(scores)): _finite(a[i]) for k, named in extras.items()
                               for n, a in named.items()}} if any(extras.values()) else {}),
                "image": files[i]}, default=str))
        atomic_write_bytes(out_dir / "results.jsonl", ("\n".join(lines) + "\n").encode())
        if shown and np.ndim(shown[0]) == 3:  # images (a video family's samples: samples/eval_NNNN.png's sheet)
            first = next(iter(scores))
            captions = [it.prompt + "".join(f"\n{k}: {v[i]:.4g}" for k, v in scores.items())
                        for i, it in enumerate(plan.items[:len(shown)])]
            save_captioned_grid(out_dir / "grid.png", np.stack(shown), captions,
                                [{"prompt": it.prompt, "reward": _finite(scores[first][i]), "file": files[i]}
                                 for i, it in enumerate(plan.items[:len(shown)])])
        doc = {"epoch": rec["epoch"], "global_step": rec["global_step"], "source": plan.source,
               "num_prompts": plan.num_prompts, "num_images": plan.num_images,
               "images_per_prompt": self.t.cfg.evaluation.images_per_prompt, "num_steps": self.steps,
               "deterministic": self.t.cfg.evaluation.deterministic,
               "guidance_scale": self.view.sample.guidance_scale, "batch_size": self.global_batch,
               "ema": self.t.cfg.train.ema, **summary}
        atomic_write_bytes(out_dir / "summary.json", (json.dumps(doc, indent=1) + "\n").encode())  # last: done


def eval_dir_name(epoch: int) -> str:
    from ddpo_tpu.rundir import events as ev

    return "before_training" if epoch == ev.BEFORE_TRAINING else f"epoch_{epoch:04d}"


def finished(out_dir: Path) -> bool:
    return (out_dir / "summary.json").is_file()


def evaluation_due(trainer, epoch: int) -> bool:
    """Evaluations run before training (epoch -1), every evaluation.every_n_epochs epochs and after the last epoch.
    One a stopped attempt finished and recorded is not run again: metrics.jsonl keeps the record of the evaluation
    before training across a resume that restarts epoch 0 (checkpointing truncates only epochs after the checkpoint),
    which ran it twice before (issue 43)."""
    cfg, rt = trainer.cfg, trainer.rt
    n = cfg.evaluation.every_n_epochs
    if not n:
        return False
    from ddpo_tpu.rundir import events as ev

    if epoch != ev.BEFORE_TRAINING and (epoch + 1) % n and epoch != cfg.num_epochs - 1:
        return False
    done = rt.is_main and epoch in recorded_evaluations(trainer.out.metrics_path)
    return not bool(rt.gather_rows(np.array([done]))[0])  # the main process's answer, on every process


def recorded_evaluations(metrics_path: Path) -> set[int]:
    """The epochs of the kind "eval" records of a metrics.jsonl."""
    out = set()
    if not metrics_path.exists():
        return out
    for line in metrics_path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if rec.get("kind") == "eval":
            out.add(rec.get("epoch"))
    return out
