"""What a run reports, each fact once: numbers go to metrics.jsonl (one line per optimizer step, epoch and
evaluation: ddpo_tpu/rundir/files.py), facts go to events.jsonl (ddpo_tpu/rundir/events.py), and the main process
mirrors the numbers to the tracker (wandb, TensorBoard: ddpo_tpu/display/tracking.py). The phase clock measures each
phase of an epoch for the epoch's line. Only the main process writes files; every process emits events (the EventLog
drops the others')."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from ddpo_tpu.rundir import events as ev
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.rundir.files import RunDir
from ddpo_tpu.runtime import Runtime
from ddpo_tpu.runtime.base import Counters


def peak_rss_gib() -> float:
    """The training process's peak resident memory so far (on PJRT CPU that includes the 'device' buffers)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@dataclass
class PhaseClock:
    """Wall time, main-thread CPU time and the runtime's counters of each phase of an epoch."""

    rt: Runtime
    events: ev.EventLog | None = None
    epoch: int = 0
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    @contextlib.contextmanager
    def measure(self, name: str):
        t0, c0, h0 = time.perf_counter(), self.rt.counters(), time.thread_time()
        yield
        d: Counters = self.rt.counters().minus(c0)
        p = self.phases[name] = {"seconds": round(time.perf_counter() - t0, 4),
                                 # CPU time of this (the main) thread: tracing, dispatch and Python; XLA executes on
                                 # other threads. Near `seconds`: the phase is host-bound
                                 "host_seconds": round(time.thread_time() - h0, 4),
                                 "compilations": d.compilations, "compile_seconds": round(d.compile_time_s, 4),
                                 **({"replicate_compilations": d.replicate_compilations}
                                    if d.replicate_compilations else {}),
                                 "host_transfers": d.host_transfers,
                                 **({"cpu_fallbacks": d.cpu_fallbacks} if d.cpu_fallbacks else {}),
                                 # distributed: what this phase's gathers left on the main process, in bytes
                                 **({"gathered_bytes": d.gathered_bytes} if d.gathered_bytes else {})}
        if self.events is not None:
            self.events.emit(ev.PhaseEnd(self.epoch, name, p["seconds"], p["host_seconds"], p["compilations"],
                                         p["compile_seconds"]))

    def total(self, key: str) -> float:
        return sum(p.get(key, 0) for p in self.phases.values())


class Reporter:
    """The run's start line, its per-step, per-epoch and evaluation records, and its summary."""

    def __init__(self, cfg: RunConfig, rt: Runtime, out: RunDir, events: ev.EventLog, tree: dict,
                 stat_names: tuple[str, ...]):
        self.cfg, self.rt, self.out, self.events, self.tree = cfg, rt, out, events, tree
        self.stat_names = stat_names
        self.tracker = None
        self._ran: list[tuple[int, float]] = []  # (epoch, reward) of the epochs this process trains
        self._t0 = time.monotonic()

    def start(self, run_id: str, start_epoch: int, layout, samples_per_batch: int, train_timesteps: int) -> None:
        from ddpo_tpu.display.tracking import make_tracker

        cfg, rt = self.cfg, self.rt
        self.tracker = make_tracker(cfg.logger, self.out.path, run_id, cfg.run_name, self.tree, rt.is_main)
        self.events.emit(ev.RunStart(rt.describe(), cfg.num_epochs, start_epoch, samples_per_batch,
                                     cfg.sample.num_batches_per_epoch, train_timesteps, layout.describe(),
                                     rt.compiles_graphs))
        self.events.emit(ev.StateLayout(**asdict(layout)))
        self._t0 = time.monotonic()

    def step(self, rec: dict) -> None:
        """An optimizer step's line (loss, statistics, gradient norm)."""
        if self.rt.is_main:
            self.out.log(rec)
            self.tracker.log({f"train/{k}": v for k, v in rec.items() if k not in ("kind", "global_step")},
                             step=rec["global_step"])

    def evaluation(self, rec: dict, images: np.ndarray | None, prompts: list[str], rewards: np.ndarray) -> None:
        """An evaluation's record (its files are the evaluator's: eval/<name>/), its first images as
        samples/eval_NNNN.png, and each panel reward's mean and std and each extra's mean in the tracker."""
        if self.rt.is_main:
            self.out.log(rec)
            before = rec["epoch"] < 0  # samples/eval_before_0000.png: the frozen policy, before epoch 0 trains
            if images is not None:
                self._save(max(rec["epoch"], 0), images, prompts, rewards, name="eval_before" if before else "eval")
            scalars = {"eval/reward_mean": rec["reward_mean"], "eval/reward_std": rec["reward_std"],
                       **{f"eval/{k}_{m}": v[m] for k, v in rec.get("rewards", {}).items() for m in ("mean", "std")},
                       **{f"eval/extras/{k}": v for k, v in rec.get("reward_extras", {}).items()}}
            self.tracker.log({k: v for k, v in scalars.items() if v is not None}, step=rec["global_step"])
        self.events.emit(ev.Evaluated(rec["epoch"], _nan(rec["reward_mean"]), _nan(rec["reward_std"])))

    def epoch(self, epoch: int, global_step: int, images: np.ndarray, prompts: list[str], rewards: np.ndarray,
              steps: list[dict], clock: PhaseClock, algorithm_metrics: dict,
              extras: dict[str, float | None] | None = None) -> None:
        """The epoch's outputs: its sample grid and its metrics line (written before the checkpoint's commit).
        `extras`: each reward extra's mean over the images it applies to (reward=weighted: its components'
        unweighted values), logged as the record's `reward_extras`."""
        rt = self.rt
        reward_mean, reward_std = float(np.nanmean(rewards)), float(np.nanstd(rewards))
        self._ran.append((epoch, reward_mean))
        if not rt.is_main:
            return
        if "zero_std_ratio" not in algorithm_metrics:  # DDPO: the same share over its prompt groups (issue 39)
            algorithm_metrics = {**algorithm_metrics, "zero_std_ratio": prompt_zero_std_ratio(rewards, prompts)}
        videos = self._save(epoch, images, prompts, rewards)
        shown = min(len(images), 16 if videos is None else len(videos))  # this process may hold fewer than the epoch
        captions = [f"{p} | {r:.4f}" for p, r in zip(prompts[:shown], rewards[:shown])]
        if videos is None:
            self.tracker.log_images(global_step, images[:shown], captions)
        else:
            self.tracker.log_videos(global_step, images[:shown], videos, captions)
        self.out.log({"kind": "epoch", "epoch": epoch, "global_step": global_step, "reward_mean": reward_mean,
                      "reward_std": reward_std, "reward_min": float(np.nanmin(rewards)),
                      "reward_max": float(np.nanmax(rewards)), "num_samples": int(rewards.size),
                      **{k: _mean(steps, k) for k in self.stat_names},
                      **algorithm_metrics,  # GRPO: kept_fraction, actual_batch_size, zero_std_ratio
                      **({"reward_extras": extras} if extras else {}),
                      "host_seconds": round(clock.total("host_seconds"), 4),
                      "host_peak_rss_gib": round(peak_rss_gib(), 3),
                      "device_peak_gib": rt.device_peak_gib(),
                      "new_compilations": int(clock.total("compilations")),
                      "new_replicate_compilations": int(clock.total("replicate_compilations")),
                      "phases": clock.phases})
        self.tracker.log({"epoch": epoch, "reward_mean": reward_mean, "reward_std": reward_std,
                          **{f"reward_extras/{k}": v for k, v in (extras or {}).items() if v is not None},
                          "phases": clock.phases}, step=global_step)

    def _save(self, epoch: int, images: np.ndarray, prompts: list[str], rewards: np.ndarray, name: str = "epoch"):
        """The samples' files: an image grid, or (videos (B, F, H, W, 3) of a video family) mp4 files and their contact
        sheet; returns the mp4 paths, or None for images."""
        if images.ndim == 5:
            return self.out.save_videos(epoch, images, prompts, rewards, name=name)
        self.out.save_image_grid(epoch, images, prompts, rewards, name=name)
        return None

    def epoch_done(self, epoch: int, rewards: np.ndarray, steps: list[dict], clock: PhaseClock,
                   extras: dict[str, float | None] | None = None) -> None:
        """The event that ends an epoch (after its commit)."""
        nan_mean = lambda k: _mean(steps, k) if steps and k in steps[0] else float("nan")  # (NFT has no ratio)
        self.events.emit(ev.EpochDone(epoch, float(np.nanmean(rewards)), float(np.nanstd(rewards)),
                                      nan_mean("approx_kl"), nan_mean("clipfrac"), len(steps), clock.phases,
                                      dict(extras or {})))

    def finish(self, global_step: int) -> None:
        self.tracker.finish()
        if not self._ran:
            self.events.emit(ev.RunComplete())
            return
        (e0, r0), (e1, r1) = self._ran[0], self._ran[-1]
        self.events.emit(ev.RunComplete(e0, e1, self.cfg.num_epochs, round((time.monotonic() - self._t0) / 60, 2),
                                        r0, r1, global_step, str(self.out.path / "weights" / "final.safetensors"),
                                        str(self.out.path / "metrics.jsonl")))


def _mean(steps: list[dict], key: str) -> float | None:
    return float(np.mean([s[key] for s in steps])) if steps else None


def zero_std_ratio(rewards: np.ndarray, group_ids: Sequence) -> float:
    """The share of groups whose rewards all equal (std 0), as flow_grpo's calculate_zero_std_ratio logs it."""
    r = np.asarray(rewards, dtype=np.float64)
    _, inverse = np.unique(np.asarray(group_ids), return_inverse=True)
    inverse = inverse.reshape(-1)
    if r.size == 0:
        return 0.0
    stds = np.array([np.std(r[inverse == g]) for g in range(int(inverse.max()) + 1)])
    return float(np.count_nonzero(stds == 0) / len(stds))


def prompt_zero_std_ratio(rewards: np.ndarray, prompts: list[str]) -> float | None:
    """The share of an epoch's prompt groups whose (finite) rewards all equal, as flow_grpo's
    calculate_zero_std_ratio counts them (zero_std_ratio above), for an algorithm that does not report
    it; None when the rewards and prompts do not pair up (a video family's prompts are per sample too)."""

    r = np.asarray(rewards, dtype=np.float64)
    if len(prompts) != r.size:
        return None
    ok = np.isfinite(r)
    return zero_std_ratio(r[ok], [p for p, k in zip(prompts, ok) if k])


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x
