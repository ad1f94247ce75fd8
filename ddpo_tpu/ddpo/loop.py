"""The DDPO epoch loop, written once against the runtime interface (ddpo_tpu/runtime). Read top to bottom:

  setup     load the model, add LoRA, build the optimizer, the prompt source, the reward, the stat tracker
  epoch:
    sample     per batch: prompts -> text embeddings -> DDIM trajectory with log-probs -> uint8 images to the host
    reward     host rewards overlap the sampling of the next batch (thread pool)
    advantages per-prompt (or whole-batch) normalisation, clipped
    train      shuffle samples and time axes on the device, PPO-clip micro-steps, one optimizer step per window
    save       metrics line, image grid, trained weights every save_freq epochs

All randomness comes from host generators seeded by (seed, epoch, stream), so every backend sees the same prompts,
noise and shuffles for the same seed, and a run restarted at an epoch boundary continues identically.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import sys
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddpo_tpu import checkpoint as ckpt
from ddpo_tpu.config.compose import Validated
from ddpo_tpu.config.rules import fused_timesteps, num_train_timesteps
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.ddpo.ppo import ppo_loss
from ddpo_tpu.ddpo.stat_tracking import PerPromptStatTracker, global_advantages
from ddpo_tpu.diffusion.ddim import DDIMTables
from ddpo_tpu.diffusion.sampling import decode_to_uint8, guided_noise_pred, make_denoise_step, sample_trajectory
from ddpo_tpu.runtime import Runtime, make_runtime
from ddpo_tpu.runtime.base import Counters
from ddpo_tpu.rewards.remote import RewardInterrupted
from ddpo_tpu.rundir import RunDir

STREAM_PROMPTS, STREAM_NOISE, STREAM_SHUFFLE = 0, 1, 2
PROGRESS_EVERY_S = 30.0  # at most one progress line per phase this often (sampling also says each batch)


def stream_seed(seed: int, epoch: int, stream: int, sub: int = 0) -> int:
    return int(np.random.SeedSequence([seed, epoch, stream, sub]).generate_state(1, dtype=np.uint64)[0] >> 1)


def peak_rss_gib() -> float:
    """The training process's peak resident memory so far (on PJRT CPU that includes the 'device' buffers)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def say(rt: Runtime, msg: str) -> None:
    if rt.is_main:
        print(msg, flush=True)


@dataclass
class EpochSamples:
    """One epoch's trajectories, global batch first, on the device."""

    latents: torch.Tensor       # (N, T+1, C, h, w)
    log_probs: torch.Tensor     # (N, T)
    step_indices: torch.Tensor  # (N, T)
    embeds: torch.Tensor        # (N, L, D)
    advantages: torch.Tensor    # (N,)


@dataclass
class PhaseClock:
    rt: Runtime
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def measure(self, name: str):
        clock = self

        class _Ctx:
            def __enter__(self):
                self.t0, self.c0, self.h0 = time.perf_counter(), clock.rt.counters(), time.thread_time()

            def __exit__(self, *exc):
                d: Counters = clock.rt.counters().minus(self.c0)
                clock.phases[name] = {"seconds": round(time.perf_counter() - self.t0, 4),
                                      # CPU time of this (the main) thread: tracing, dispatch and Python; XLA
                                      # executes on other threads. Near `seconds`: the phase is host-bound
                                      "host_seconds": round(time.thread_time() - self.h0, 4),
                                      "compilations": d.compilations, "compile_seconds": round(d.compile_time_s, 4),
                                      **({"replicate_compilations": d.replicate_compilations}
                                         if d.replicate_compilations else {}),
                                      "host_transfers": d.host_transfers,
                                      **({"cpu_fallbacks": d.cpu_fallbacks} if d.cpu_fallbacks else {})}

        return _Ctx()


class Preempted(Exception):
    """SIGTERM: the trainer reached a safe point and wrote a checkpoint."""


class StopRequest:
    """SIGTERM sets a flag checked at safe points (between sampling batches, at the end of an epoch); a second
    SIGTERM (or SIGINT) exits at once."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if self.requested:
            print(f"ddpo_tpu: second {signal.Signals(signum).name}: exiting now", flush=True)
            import os

            os._exit(128 + signum)
        self.requested = True
        print(f"ddpo_tpu: {signal.Signals(signum).name} received: stopping at the next safe point", flush=True)


class NonFinite(RuntimeError):
    pass


class CannotStart(RuntimeError):
    """The run dir cannot hold this run (permissions, disk space): found before any training."""


class Trainer:
    def __init__(self, cfg: RunConfig, rt: Runtime, out: RunDir, tree: dict | None = None,
                 stop: StopRequest | None = None):
        from ddpo_tpu.models.from_config import load_from_config
        from ddpo_tpu.models.lora import make_trainable
        from ddpo_tpu.prompts import make_prompt_source
        from ddpo_tpu.rewards import make_reward

        self.cfg, self.rt, self.out = cfg, rt, out
        self.tree = tree if tree is not None else cfg.model_dump()
        self.stop = stop or StopRequest()
        self.mixed = cfg.train.mixed_precision == "bf16"
        torch.manual_seed(cfg.seed)  # adapter init: drawn on the host, identical on every backend
        comps = load_from_config(cfg.model)
        self.tokenizer, self.scheduler = comps.tokenizer, comps.scheduler
        make_trainable(comps.unet, cfg.model)
        self.unet = comps.unet.to(rt.device)
        self.vae = comps.vae.to(rt.device)
        self.text_encoder = comps.text_encoder.to(rt.device)
        # after .to(device): moving to an XLA device may replace the Parameter objects
        self.params = [p for p in self.unet.parameters() if p.requires_grad]
        t = cfg.train
        self.optimizer = torch.optim.AdamW(self.params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                                           weight_decay=t.adam_weight_decay, eps=t.adam_epsilon)
        # every UNet weight (frozen ones too) replicated or split on the fsdp axis; then each gradient and moment
        # placed as it is made, so under fsdp they are never whole on a device
        rt.place_state(self.unet.parameters())
        # AdamW's state as its first step would create it (step on the host, zero moments), but uploaded as data:
        # created lazily inside the first step it would make that step a graph of its own, compiled again at the
        # second step (in epoch 1 when an epoch has a single update)
        for p in self.params:
            st = self.optimizer.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                            "exp_avg": torch.zeros(p.shape, dtype=p.dtype).to(rt.device),
                                            "exp_avg_sq": torch.zeros(p.shape, dtype=p.dtype).to(rt.device)}
            # gradients too (backward accumulates into them, zero_grad zeroes them in place): one layout for the
            # first micro-step and every later one. (A trainable weight no loss reaches would now get AdamW's weight
            # decay where a None gradient skipped it; LoRA and the UNet reach every one.)
            p.grad = torch.zeros(p.shape, dtype=p.dtype).to(rt.device)
            rt.place_state([p.grad, st["exp_avg"], st["exp_avg_sq"]])
        self.tables = DDIMTables.from_scheduler(self.scheduler, cfg.sample.num_steps, rt.device)
        p = cfg.prompts
        self.prompts = make_prompt_source(p.name, file=p.file, nouns_file=p.nouns_file,
                                          activities_file=p.activities_file)
        # reward-specific keys of the reward group (clip_model, mlp_path, ...) go to the reward's constructor
        extra = cfg.reward.model_dump(exclude={"name", "host_workers"}, exclude_none=True)
        if extra.get("clip_model") == "tiny":  # model=tiny pairs with tiny stand-ins (conf/reward_local)
            from ddpo_tpu.rewards.tiny_clip import ensure_tiny_aesthetic

            clip, mlp = ensure_tiny_aesthetic(Path(cfg.model.cache_dir).expanduser())
            extra.update(clip_model=str(clip), **({"mlp_path": str(mlp)} if "mlp_path" in extra else {}))
        if cfg.reward.name in ("aesthetic", "clip_score") and rt.device.type == "cuda":
            extra["device"] = str(rt.device)  # CLIP rewards stay on a CUDA device; on XLA they run on the host CPU
        self.reward = make_reward(cfg.reward.name, **extra)
        for r in (self.reward, *getattr(self.reward, "components", ())):
            if hasattr(r, "should_stop"):  # remote rewards: a SIGTERM ends a hanging request within a second
                r.should_stop = lambda: self.stop.requested
        self.pool = ThreadPoolExecutor(cfg.reward.host_workers) if cfg.reward.host_workers else None
        self.tracker = PerPromptStatTracker(cfg.stat_tracking.buffer_size, cfg.stat_tracking.min_count)
        self.global_batch = cfg.sample.batch_size * rt.replicas
        self.train_batch = cfg.train.batch_size * rt.replicas
        self.train_timesteps = num_train_timesteps(cfg)
        self.window = cfg.train.gradient_accumulation_steps * self.train_timesteps  # trained timesteps per update
        self.fused = fused_timesteps(cfg)  # timesteps per forward/backward (divides train_timesteps)
        self.latent_shape = (self.unet.config.in_channels, self.unet.config.sample_size, self.unet.config.sample_size)
        with torch.no_grad():
            neg = self.encode([""])  # (1, L, D): the unconditional prompt
            # expanded once and materialised here: a view created per epoch would join (and change) the next graph
            self.uncond_sample = rt.shard_batch(neg.expand(self.global_batch, -1, -1).contiguous())
            self.uncond_train = rt.shard_batch(neg.expand(self.train_batch * self.fused, -1, -1).contiguous())
        rt.sync()
        # the two functions every step runs, compiled once by backends that can (xla.step_compiler)
        autocast = lambda: rt.autocast(self.mixed)
        self.denoise_step = rt.compile_step(make_denoise_step(self.unet, self.tables, eta=cfg.sample.eta,
                                                              guidance_scale=cfg.sample.guidance_scale,
                                                              autocast=autocast))
        self.micro_step_loss = rt.compile_step(self._make_micro_step_loss(autocast))
        self._check_room()
        self.global_step = 0
        self.start_epoch = 0
        self.run_id = uuid.uuid4().hex[:12]
        self.last_saved_epoch = -1
        self._resume()
        self.layout = rt.state_layout([*self.unet.parameters(), *(p.grad for p in self.params),
                                       *(t for st in self.optimizer.state.values() for t in st.values())])
        if rt.is_main:
            out.log({"kind": "event", "event": "state_layout", **asdict(self.layout)})
        from ddpo_tpu.tracking import make_tracker

        self.logger = make_tracker(cfg.logger, out.path, self.run_id, cfg.run_name, self.tree, rt.is_main)

    # --- checkpoints --------------------------------------------------------------------------------------------
    def _check_room(self) -> None:
        """Before any training: the run dir is writable and has room for the checkpoints it will keep."""
        import os
        import shutil

        path = self.out.path
        if not os.access(path, os.W_OK):
            raise CannotStart(f"run dir {path} is not writable: fix its permissions or set output_root=...")
        per_ckpt = sum(p.numel() * 4 for p in self.params) * 4  # weights x2 (checkpoint + weights/) + Adam moments
        need = per_ckpt * (min(self.cfg.checkpoint_limit, self.cfg.num_epochs) + 1)
        free = shutil.disk_usage(path).free
        if free < need:
            raise CannotStart(f"run dir {path} has {free / 2**30:.1f} GiB free but {self.cfg.checkpoint_limit} "
                                     f"checkpoint(s) need about {need / 2**30:.1f} GiB: free space, lower "
                                     f"checkpoint_limit, or set output_root=... on a larger disk")

    @property
    def ckpt_root(self) -> Path:
        return self.out.path / "checkpoints"

    def _resume(self) -> None:
        from ddpo_tpu.models.lora import load_trainable_state_dict

        cfg = self.cfg
        if cfg.resume == "never" and ckpt.complete(self.ckpt_root):
            raise ckpt.ResumeRefused(f"resume=never but {self.ckpt_root} holds checkpoints of an earlier run: use "
                                     f"resume=auto to continue it or a new run_name to start over")
        def damaged(e: ckpt.CheckpointDamaged) -> None:
            if self.rt.is_main:
                self.out.log({"kind": "event", "event": "checkpoint_damaged", "checkpoint": str(e.path),
                              "problem": e.problem})
            say(self.rt, f"ddpo_tpu: warning: {e}; trying the previous checkpoint")

        loaded = ckpt.load_resume(self.out.path, cfg.resume, self.tree, force=cfg.force_resume, on_damaged=damaged)
        if loaded is None:
            self.out.truncate_after_epoch(-1)  # a run killed before its first checkpoint starts clean
            return
        path = loaded.path
        load_trainable_state_dict(self.unet, cfg.model, {k: v.to(self.rt.device) for k, v in loaded.trainable.items()})
        self.rt.place_state(self.params)  # copy_ into an XLA tensor drops its sharding: pin the loaded weights again
        self._load_optimizer(loaded.optimizer)
        self.tracker.load_state_dict(loaded.tracker)
        self.start_epoch, self.global_step = loaded.epoch + 1, loaded.global_step
        self.run_id, self.last_saved_epoch = loaded.run_id, loaded.epoch
        self.out.truncate_after_epoch(loaded.epoch)  # epochs after the checkpoint are logged again, once
        self.rt.sync()
        if self.rt.is_main:
            self.out.log({"kind": "event", "event": "resumed", "epoch": loaded.epoch, "global_step": self.global_step,
                          "checkpoint": str(path)})
        say(self.rt, f"ddpo_tpu: resumed from {path} (epoch {loaded.epoch} done, global step {self.global_step})")

    def _load_optimizer(self, saved: dict) -> None:
        """A saved AdamW state, one parameter at a time: each moment uploaded, cast as load_state_dict would, and
        placed as it arrives (load_state_dict would upload them all replicated beside the fresh ones)."""
        self.optimizer.load_state_dict({**saved, "state": {}})  # the groups' hyperparameters; drops the fresh state
        ids = [i for group in saved["param_groups"] for i in group["params"]]
        for i, p in zip(ids, self.params, strict=True):
            st = saved["state"][i]
            moments = {k: st[k].to(dtype=p.dtype).to(self.rt.device) for k in ("exp_avg", "exp_avg_sq")}
            self.optimizer.state[p] = {"step": st["step"].to(torch.float32), **moments}
            self.rt.place_state(moments.values())

    def save_checkpoint(self, epoch: int, tracker_state: dict, commit: bool = True) -> ckpt.Pending | None:
        """Weights, optimizer and stat tracker as they are at the end of `epoch`. With commit=False the checkpoint is
        written but not yet in place: the caller writes the epoch's metrics line and grid, then commits it, so a
        kill at any point either finds all of the epoch's outputs or redoes the epoch."""
        trainable = self.trainable_state()
        opt = self.optimizer.state_dict()
        flat = {f"{k}/{n}": t for k, v in opt["state"].items() for n, t in v.items() if torch.is_tensor(t)}
        host = self.rt.state_to_host(flat)  # one sync, then plain copies
        opt["state"] = {k: {n: host.get(f"{k}/{n}", t) for n, t in v.items()} for k, v in opt["state"].items()}
        pending = None
        if self.rt.is_main:
            # the weights first: an epoch whose checkpoint is in place has its weights files too
            self.out.save_weights(f"epoch_{epoch:04d}", trainable)
            if epoch + 1 == self.cfg.num_epochs:
                self.out.save_weights("final", trainable)
            pending = ckpt.prepare(self.ckpt_root, epoch=epoch, global_step=self.global_step, trainable=trainable,
                                   optimizer=opt, tracker=tracker_state, run_id=self.run_id, tree=self.tree)
        if commit:
            self.commit_checkpoint(epoch, pending)
        return pending

    def commit_checkpoint(self, epoch: int, pending: ckpt.Pending | None) -> None:
        """The rename that marks `epoch` done (main process; the others only note it)."""
        if pending is not None:
            path = pending.commit(self.cfg.checkpoint_limit)
            self.out.log({"kind": "event", "event": "checkpoint", "epoch": epoch, "global_step": self.global_step,
                          "path": str(path)})
            say(self.rt, f"[epoch {epoch}] checkpoint {path}")
        self.last_saved_epoch = epoch

    def _saved_state(self) -> str:
        """What a stop leaves to resume from, for its message."""
        if self.last_saved_epoch < 0:
            return "no checkpoint was written yet (the same command starts over)"
        return f"the last checkpoint (epoch {self.last_saved_epoch}) is intact"

    def _stop_if_requested(self, epoch_done: int, tracker_state: dict) -> None:
        """At a safe point: write the state as of the end of `epoch_done` (unless saved already) and stop."""
        if not self.stop.requested:
            return
        if epoch_done >= 0 and self.last_saved_epoch != epoch_done:
            self.save_checkpoint(epoch_done, tracker_state)
        if self.rt.is_main:
            self.out.log({"kind": "event", "event": "preempted", "epoch": epoch_done, "global_step": self.global_step})
        if epoch_done < 0:
            raise Preempted("stopped before the first epoch was done (no checkpoint yet); the same command starts over")
        raise Preempted(f"stopped after epoch {epoch_done}; the same command resumes")

    # --- pieces -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
        ids = self.rt.shard_batch(ids.to(self.rt.device)) if len(prompts) > 1 else ids.to(self.rt.device)
        return self.text_encoder(ids)[0]

    def _score(self, images: np.ndarray, prompts: list[str]) -> Future | np.ndarray:
        if self.pool is None:
            return self.reward(images, prompts)
        return self.pool.submit(self.reward, images, prompts)

    def sample_epoch(self, epoch: int) -> tuple[list[torch.Tensor], list[str], list[Any], np.ndarray]:
        cfg, rt = self.cfg, self.rt
        prompt_rng = np.random.default_rng(stream_seed(cfg.seed, epoch, STREAM_PROMPTS))
        noise_gen = torch.Generator().manual_seed(stream_seed(cfg.seed, epoch, STREAM_NOISE))
        self.unet.eval()
        parts, prompts_all, pending, first_images = [], [], [], None
        B, T = self.global_batch, self.tables.num_steps
        uncond = self.uncond_sample
        for b in range(cfg.sample.num_batches_per_epoch):
            prompts = self.prompts.sample(B, prompt_rng)
            init = torch.randn((B, *self.latent_shape), generator=noise_gen)
            noise = torch.randn((T, B, *self.latent_shape), generator=noise_gen)
            cond = self.encode(prompts)
            traj = sample_trajectory(self.unet, self.tables, cond, uncond, init, noise, eta=cfg.sample.eta,
                                     guidance_scale=cfg.sample.guidance_scale, rt=rt,
                                     sync_every=cfg.xla.sync_every_n_denoising_steps, step=self.denoise_step)
            with rt.autocast(self.mixed):
                images = decode_to_uint8(self.vae, traj.latents[:, -1])
            host_images = rt.to_host(images).numpy()  # the one device-to-host copy of this batch
            pending.append(self._score(host_images, prompts))
            parts.append((traj, cond))
            prompts_all.extend(prompts)
            if first_images is None:
                first_images = host_images
            if (b + 1) % cfg.xla.sync_every_n_sampling_batches == 0:
                rt.sync()
            say(rt, f"[epoch {epoch}] sampling batch {b + 1}/{cfg.sample.num_batches_per_epoch} done")
            self._stop_if_requested(epoch - 1, self.tracker.state_dict())
        return parts, prompts_all, pending, first_images

    def evaluate(self, epoch: int) -> dict:
        """Fixed prompts and fixed noise, one sampling batch (the sampling graphs, so nothing new compiles)."""
        cfg, rt = self.cfg, self.rt
        B, T = self.global_batch, self.tables.num_steps
        ev = cfg.evaluation
        prompts = [ev.prompts[i % len(ev.prompts)] for i in range(B)]
        gen = torch.Generator().manual_seed(ev.seed)
        init = torch.randn((B, *self.latent_shape), generator=gen)
        noise = torch.randn((T, B, *self.latent_shape), generator=gen)
        self.unet.eval()
        traj = sample_trajectory(self.unet, self.tables, self.encode(prompts), self.uncond_sample, init, noise,
                                 eta=cfg.sample.eta, guidance_scale=cfg.sample.guidance_scale, rt=rt,
                                 sync_every=cfg.xla.sync_every_n_denoising_steps, step=self.denoise_step)
        with rt.autocast(self.mixed):
            images = rt.to_host(decode_to_uint8(self.vae, traj.latents[:, -1])).numpy()
        rewards = np.asarray(self.reward(images, prompts), dtype=np.float64)
        per_prompt = {p: float(np.mean([r for q, r in zip(prompts, rewards) if q == p])) for p in ev.prompts}
        rec = {"kind": "eval", "epoch": epoch, "global_step": self.global_step, "reward_mean": float(rewards.mean()),
               "reward_std": float(rewards.std()), "per_prompt": per_prompt}
        if rt.is_main:
            self.out.log(rec)
            self.out.save_image_grid(epoch, images, prompts, rewards, name="eval")
            self.logger.log({"eval/reward_mean": rec["reward_mean"]}, step=self.global_step)
        say(rt, f"[epoch {epoch}] eval: reward {rec['reward_mean']:.4f} +- {rec['reward_std']:.4f}")
        return rec

    def advantages(self, prompts: list[str], rewards: np.ndarray) -> np.ndarray:
        if self.cfg.stat_tracking.per_prompt:
            return self.tracker.update(prompts, rewards)
        return global_advantages(rewards)

    def train_epoch(self, epoch: int, s: EpochSamples) -> list[dict[str, float]]:
        cfg, rt = self.cfg, self.rt
        self.unet.train()
        N, T = s.log_probs.shape
        dev = rt.device
        logs = []
        micro, said = 0, time.monotonic()
        total = cfg.train.num_inner_epochs * N * self.train_timesteps // self.train_batch
        stats = torch.zeros(3).to(dev)  # uploaded data, not a pending constant that would join the next graph
        for inner in range(cfg.train.num_inner_epochs):
            gen = torch.Generator().manual_seed(stream_seed(cfg.seed, epoch, STREAM_SHUFFLE, inner))
            # shuffles: random keys from the host generator, argsort + gather on the device (fixed shapes)
            perm = torch.argsort(torch.rand(N, generator=gen).to(dev))
            if cfg.xla.shuffle_timesteps:
                tperm = torch.argsort(torch.rand((N, T), generator=gen).to(dev), dim=1)
            else:
                tperm = torch.arange(T).expand(N, T).contiguous().to(dev)
            # materialise the permutations first: on torch_xla 2.9 (PJRT CPU) an index_select whose index is a
            # pending sort aborts the process (xla/shape.h "buffer != nullptr"); one small graph, same every epoch
            rt.sync()
            lat = s.latents.index_select(0, perm)
            gat = lambda x: torch.gather(x, 1, tperm.view(N, T, *([1] * (x.dim() - 2))).expand(N, T, *x.shape[2:]))
            cur, nxt = gat(lat[:, :-1]), gat(lat[:, 1:])
            old_lp = gat(s.log_probs.index_select(0, perm))
            idx = gat(s.step_indices.index_select(0, perm))
            emb = s.embeds.index_select(0, perm)
            adv = s.advantages.index_select(0, perm)
            rt.sync()
            uncond = self.uncond_train if cfg.train.cfg else None
            K = self.fused
            for b in range(N // self.train_batch):
                sel = torch.arange(b * self.train_batch, (b + 1) * self.train_batch).to(dev)
                batch = [x.index_select(0, sel) for x in (cur, nxt, old_lp, idx, emb, adv)]
                for j in range(0, self.train_timesteps, K):
                    # this micro-step's K timesteps, uploaded as data: one graph for every j
                    cols = torch.arange(j, j + K).to(dev)
                    loss, kl, clipfrac = self.micro_step_loss(*batch, cols, uncond)
                    # the mean over K x B terms is the mean of K per-timestep means: scaled back to their sum, each
                    # timestep weighs what it weighs unfused (1 / trained timesteps per update)
                    (loss / (self.window // K)).backward()
                    stats = stats + K * torch.stack([loss.detach(), kl, clipfrac])
                    micro += K
                    if micro % self.window == 0:
                        logs.append(self._update(epoch, stats / self.window))
                        stats = torch.zeros(3).to(dev)  # uploaded data, not a pending constant that would join the next graph
                    else:
                        rt.sync()
                    if time.monotonic() - said > PROGRESS_EVERY_S:  # a long phase is not a silent one
                        said = time.monotonic()
                        say(rt, f"[epoch {epoch}] training: {micro}/{total} timesteps trained, {len(logs)} optimizer "
                                f"step(s) done")
        return logs

    def _make_micro_step_loss(self, autocast):
        """The PPO-clip loss of K timesteps (columns `cols` of the time axis) of one train batch, fused into one
        guided forward of B x K samples (sample-major, so each data-parallel shard keeps its own samples). Returns
        (loss, approx_kl, clipfrac), each a mean over the B x K terms."""
        cfg, unet, tables = self.cfg, self.unet, self.tables

        def micro_step_loss(cur, nxt, old_lp, idx, emb, adv, cols, uncond):
            B, K = cur.shape[0], cols.shape[0]
            flat = lambda x: x.index_select(1, cols).reshape(B * K, *x.shape[2:])
            x_j, next_j, lp_old, i_j = flat(cur), flat(nxt), flat(old_lp), flat(idx)
            with autocast():
                eps = guided_noise_pred(unet, x_j, tables.timestep_at(i_j), emb.repeat_interleave(K, dim=0), uncond,
                                        cfg.sample.guidance_scale)
            _, lp = tables.step(eps.float(), i_j, x_j, cfg.sample.eta, prev_sample=next_j)
            loss, info = ppo_loss(lp, lp_old, adv.repeat_interleave(K), cfg.train.clip_range, cfg.train.adv_clip_max)
            return loss, info["approx_kl"], info["clipfrac"]

        return micro_step_loss

    def _update(self, epoch: int, stats: torch.Tensor) -> dict[str, float]:
        rt = self.rt
        with (rt.profile(self.out.path, self.global_step) if self.global_step in self.cfg.xla.profile_steps
              else contextlib.nullcontext()):
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
            rt.optimizer_step(self.optimizer)
            self.optimizer.zero_grad(set_to_none=False)
        host = rt.to_host(torch.cat([stats, norm.reshape(1).float()])).tolist()  # one copy per optimizer step
        self.global_step += 1
        if not all(np.isfinite(host)):
            raise NonFinite(f"non-finite loss or gradient at global step {self.global_step} (loss {host[0]}, "
                            f"grad norm {host[3]}): stopped; {self._saved_state()}. Try a lower "
                            f"train.learning_rate or train.mixed_precision=no")
        rec = {"kind": "step", "epoch": epoch, "global_step": self.global_step, "loss": host[0],
               "approx_kl": host[1], "clipfrac": host[2], "grad_norm": host[3]}
        if rt.is_main:
            self.out.log(rec)
            self.logger.log({f"train/{k}": v for k, v in rec.items() if k not in ("kind", "global_step")},
                                 step=self.global_step)
        return rec

    def trainable_state(self) -> dict[str, torch.Tensor]:
        from ddpo_tpu.models.lora import trainable_state_dict

        return self.rt.state_to_host(trainable_state_dict(self.unet, self.cfg.model, to_host=False))

    # --- the loop -----------------------------------------------------------------------------------------------
    def fit(self) -> None:
        cfg, rt, out = self.cfg, self.rt, self.out
        say(rt, f"ddpo_tpu: {rt.describe()}; {cfg.num_epochs} epochs of {self.global_batch} x "
                f"{cfg.sample.num_batches_per_epoch} samples, {self.train_timesteps} train timesteps; "
                f"{self.layout.describe()}")
        if rt.compiles_graphs:
            say(rt, f"ddpo_tpu: epoch {self.start_epoch} compiles the graphs first (the denoising step, the training "
                    f"micro-step, the update; minutes at Stable Diffusion scale); later epochs reuse them")
        ran, t0 = [], time.monotonic()  # (epoch, reward) of the epochs this process trains, for the summary
        for epoch in range(self.start_epoch, cfg.num_epochs):
            tracker_at_start = self.tracker.state_dict()  # what a checkpoint of epoch-1 holds
            clock = PhaseClock(rt)
            say(rt, f"[epoch {epoch}] sampling start")
            try:
                with clock.measure("sampling"):
                    parts, prompts, pending, first_images = self.sample_epoch(epoch)
                with clock.measure("reward"):
                    if cfg.xla.sync_before_reward_gather:
                        rt.sync()
                    rewards = np.concatenate([f.result() if isinstance(f, Future) else f for f in pending])
                    bad = ~np.isfinite(rewards)
                    if bad.any() and cfg.on_nonfinite_reward == "stop":
                        raise NonFinite(f"reward.name={cfg.reward.name} returned {int(bad.sum())} non-finite value(s) "
                                        f"in epoch {epoch}: stopped; {self._saved_state()} (on_nonfinite_reward=skip "
                                        f"gives those samples zero advantage instead)")
            except RewardInterrupted:  # SIGTERM while a remote reward hung: the state as of the previous epoch
                self._stop_if_requested(epoch - 1, tracker_at_start)
                raise
            say(rt, f"[epoch {epoch}] rewards gathered: mean {rewards.mean():.4f} std {rewards.std():.4f}")
            with clock.measure("advantages"):
                if bad.any():
                    say(rt, f"[epoch {epoch}] {int(bad.sum())} non-finite reward(s): zero advantage for those samples")
                    keep = ~bad
                    adv = np.zeros_like(rewards, dtype=np.float32)
                    adv[keep] = self.advantages([p for p, k in zip(prompts, keep) if k], rewards[keep])
                    rewards = np.where(bad, np.nan, rewards)
                else:
                    adv = self.advantages(prompts, rewards)
                if not np.isfinite(adv).all():
                    raise NonFinite(f"non-finite advantages in epoch {epoch}: stopped; {self._saved_state()}")
                samples = EpochSamples(
                    latents=torch.cat([t.latents for t, _ in parts]),
                    log_probs=torch.cat([t.log_probs for t, _ in parts]),
                    step_indices=torch.cat([t.step_indices for t, _ in parts]),
                    embeds=torch.cat([c for _, c in parts]),
                    advantages=rt.shard_batch(torch.as_tensor(adv, dtype=torch.float32).to(rt.device)),
                )
                del parts
            say(rt, f"[epoch {epoch}] training start")
            with clock.measure("training"):
                steps = self.train_epoch(epoch, samples)
            del samples
            if cfg.evaluation.every_n_epochs and (epoch + 1) % cfg.evaluation.every_n_epochs == 0:
                with clock.measure("evaluation"):
                    self.evaluate(epoch)
            saving = (epoch + 1) % cfg.save_freq == 0 or epoch + 1 == cfg.num_epochs or self.stop.requested
            with clock.measure("checkpoint"):  # the copy to the host and the writes; the commit comes last
                pending = self.save_checkpoint(epoch, self.tracker.state_dict(), commit=False) if saving else None
            if rt.is_main:
                out.save_image_grid(epoch, first_images, prompts, rewards)
                self.logger.log_images(self.global_step, first_images[:16],
                                            [f"{p} | {r:.4f}" for p, r in zip(prompts[:16], rewards[:16])])
                mean = lambda k: float(np.mean([s[k] for s in steps])) if steps else None
                out.log({"kind": "epoch", "epoch": epoch, "global_step": self.global_step,
                         "reward_mean": float(np.nanmean(rewards)), "reward_std": float(np.nanstd(rewards)),
                         "num_samples": int(rewards.size), "loss": mean("loss"), "approx_kl": mean("approx_kl"),
                         "clipfrac": mean("clipfrac"),
                         "host_seconds": round(sum(p["host_seconds"] for p in clock.phases.values()), 4),
                         "host_peak_rss_gib": round(peak_rss_gib(), 3),
                         "new_compilations": sum(p["compilations"] for p in clock.phases.values()),
                         "new_replicate_compilations": sum(p.get("replicate_compilations", 0)
                                                           for p in clock.phases.values()),
                         "phases": clock.phases})
                self.logger.log({"epoch": epoch, "reward_mean": float(np.nanmean(rewards)),
                                      "reward_std": float(np.nanstd(rewards)), "phases": clock.phases},
                                     step=self.global_step)
            if saving:  # after every output of the epoch: a kill before this line redoes the epoch
                self.commit_checkpoint(epoch, pending)
            kl, cf = (float(np.mean([st[k] for st in steps])) if steps else float("nan") for k in ("approx_kl", "clipfrac"))
            say(rt, f"[epoch {epoch}] done: reward {np.nanmean(rewards):.4f} +- {np.nanstd(rewards):.4f}, "
                    f"approx_kl {kl:.2e}, clipfrac {cf:.3f}, {len(steps)} updates, "
                    + ", ".join(f"{k} {v['seconds']:.1f}s/{v['compilations']}c"
                                + (f"+{v['replicate_compilations']}r" if "replicate_compilations" in v else "")
                                for k, v in clock.phases.items()))
            self._stop_if_requested(epoch, self.tracker.state_dict())
            ran.append((epoch, float(np.nanmean(rewards))))
        if self.pool is not None:
            self.pool.shutdown()
        self.logger.finish()
        if ran:
            (e0, r0), (e1, r1) = ran[0], ran[-1]
            say(rt, f"ddpo_tpu: summary: epochs {e0}-{e1} of {cfg.num_epochs} in {(time.monotonic() - t0) / 60:.1f} min "
                    f"(this process), reward {r0:.4f} -> {r1:.4f}, {self.global_step} optimizer steps in all; weights "
                    f"{out.path / 'weights' / 'final.safetensors'}; metrics {out.path / 'metrics.jsonl'}")


_STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def storage_error_line(e: OSError, run_dir: Path) -> str:
    """One line for a write the run dir's disk refused. Checkpoints are written whole and renamed into place, so the
    last complete one is intact whatever write failed."""
    path = e.filename or run_dir
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what, fix = "no space left on the disk", "free space there or set output_root=... on a larger disk"
    else:
        what, fix = f"cannot write there ({e.strerror})", "make the run dir writable or set output_root=..."
    return f"{path}: {what}: {fix}; the same command then resumes from the last complete checkpoint"


def run(validated: Validated, run_dir: Path) -> int:
    from ddpo_tpu.launch.process import EXIT_FAILED, EXIT_PREEMPTED
    from ddpo_tpu.models.loading import ModelLoadError
    from ddpo_tpu.rewards import RewardError

    stop = StopRequest()
    rt = make_runtime(validated.cfg)
    try:
        trainer = Trainer(validated.cfg, rt, RunDir(run_dir), tree=validated.tree, stop=stop)
        if trainer.start_epoch >= validated.cfg.num_epochs:
            say(rt, f"ddpo_tpu: run complete (all {validated.cfg.num_epochs} epochs were done already)")
            return 0
        trainer.fit()
    except Preempted as e:
        say(rt, f"ddpo_tpu: preempted: {e}")
        return EXIT_PREEMPTED
    except (ckpt.ResumeRefused, CannotStart, NonFinite, RewardError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except OSError as e:
        if e.errno not in _STORAGE_ERRORS:
            raise
        print(f"error: {storage_error_line(e, run_dir)}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    say(rt, "ddpo_tpu: run complete")
    return 0
