"""The training loop, written once against small interfaces: a runtime (ddpo_tpu/runtime: eager, XLA, SPMD), a model
family (ddpo_tpu/families: encode, a denoising step with its log-prob, decode) and an algorithm (algorithms/base.py:
advantages and the loss). Read `Trainer.fit` top to bottom:

  sample      per batch: prompts -> conditioning -> trajectory with log-probs -> uint8 images to the host
  reward      host rewards overlap the sampling of the next batch (thread pool; training/reward_overlap.py)
  advantages  the algorithm's normalisation of the rewards
  train       shuffle samples and time axes on the device, clipped-objective micro-steps, an update per window
  save        weights and checkpoint written, the epoch's metrics line and grid, then the commit (its rename)

All randomness comes from host generators seeded by (seed, epoch, stream), so every backend sees the same prompts,
noise and shuffles for the same seed, and a run restarted at an epoch boundary continues identically. Checkpoints,
resume and the stop point are training/checkpointing.py's; what the run reports (metrics, events, trackers) is
training/reporting.py's; the process around the Trainer (errors to one line, exit codes) is ddpo_tpu/worker.py's.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddpo_tpu.rundir import events as ev
from ddpo_tpu.catalog.reward_checks import request_bound_s
from ddpo_tpu.config.plan import RunPlan, run_plan
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.rewards.weighted import component_weights
from ddpo_tpu.random_streams import NOISE, PROMPTS, stream_seed
from ddpo_tpu.training.checkpointing import CheckpointManager, StopRequest
from ddpo_tpu.training.epoch_data import EpochSamples, drawn_rows, epoch_samples, extras_means, gather_extras
from ddpo_tpu.training.ppo_epoch import PpoEpochTrainer
from ddpo_tpu.training.stepper import EpochContext, NonFinite, Stepper, StepShape
from ddpo_tpu.training.reporting import PhaseClock, Reporter
from ddpo_tpu.training.reward_overlap import RewardTiming
from ddpo_tpu.training.state import TrainState
from ddpo_tpu.diffusion.sampling import Trajectory, sample_trajectory
from ddpo_tpu.diffusion.window import sde_window_at
from ddpo_tpu.families import Cond, load_family
from ddpo_tpu.rewards.base import RewardScores, score_with
from ddpo_tpu.rewards.remote import RewardInterrupted
from ddpo_tpu.rundir.files import RunDir
from ddpo_tpu.runtime import Runtime

@dataclass
class SampledEpoch:
    """What sampling an epoch produced: trajectories and conditioning on the device, rewards pending on the host."""

    trajectories: list[Trajectory]
    conds: list[Cond]
    prompts: list[str]
    pending_rewards: list        # per batch: a Future or an array
    first_images: np.ndarray     # the first batch's uint8 images, or a video family's videos (the samples' files)
    scores: dict | None = None   # the algorithm's own per-image scores, gathered (GARDO: auxiliary rewards, features)
    extras: dict | None = None   # the reward's extras (RewardScores.extras), gathered: name -> (N,), NaN = n/a
    components: dict | None = None  # algorithm.advantage_aggregation=gdpo: reward=weighted's components, gathered


def make_algorithm(cfg, plan: RunPlan | None = None):
    """The run's algorithm (algorithms/base.py `Algorithm`), found through its catalog spec: the loop names no
    algorithm, as it names no family. `plan`: the run plan it reads its planned quantities from (the Trainer's;
    None: run_plan(cfg), for a caller without a validated plan at hand)."""
    from ddpo_tpu.catalog import ALGORITHMS, load_object

    return load_object(ALGORITHMS.get(cfg.algorithm.name).module)(cfg, plan if plan is not None else run_plan(cfg))


def step_shape(plan: RunPlan) -> StepShape:
    """The optimizer steps' shape, as the run plan decided it: fused timesteps per forward/backward (divides the
    trained timesteps), the global train batch, trained timesteps per update."""
    return StepShape(train_timesteps=plan.train_timesteps, fused=plan.fused_timesteps,
                     train_batch=plan.global_train_batch, window=plan.accumulation_window)


class Trainer:
    """Builds a run's parts from its config; `resume()` restores a checkpoint; `fit()` trains. Building reads the
    run dir (is it writable, is there room) but changes nothing in it. `plan`: the run's decisions as validation
    made them (config/plan.py; `Validated.plan`); None computes them from `cfg` here, once."""

    def __init__(self, cfg: RunConfig, rt: Runtime, out: RunDir, tree: dict | None = None,
                 stop: StopRequest | None = None, events: ev.EventLog | None = None, plan: RunPlan | None = None):
        from ddpo_tpu.prompts import source_from_config
        from ddpo_tpu.rewards.from_config import reward_from_config

        self.cfg, self.rt, self.out = cfg, rt, out
        self.plan = plan = plan if plan is not None else run_plan(cfg)
        if rt.replicas != plan.replicas:  # the launch found other devices than the topology the plan was made for
            raise ValueError(f"tpu_topology={cfg.tpu_topology.name} plans {plan.replicas} replica(s) but the "
                             f"{rt.name} runtime has {rt.replicas}: check tpu_topology against this machine")
        self.tree = tree if tree is not None else cfg.model_dump()
        self.stop = stop or StopRequest()
        self.events = events or ev.EventLog(out.path, rt.is_main)
        self.mixed = cfg.train.mixed_precision == "bf16"
        torch.manual_seed(cfg.seed)  # adapter init: drawn on the host, identical on every backend
        self.family = load_family(cfg, rt)
        if plan.activation_checkpointing:  # the backward runs each block again from its kept input
            self.family.model.enable_gradient_checkpointing(rt.checkpoint_function())
        self.family.denoiser = rt.prepare_model(self.family.model)  # DDP's wrapper, or FSDP2 in place
        self.state = TrainState(self.family.model, cfg.train, rt)
        self.algorithm = make_algorithm(cfg, plan)
        self.prompts = source_from_config(cfg.prompts)  # a dataset's rows carry metadata for the reward
        # a video family scores every frame with the (image) reward and reduces over frames
        self.reward = self.family.wrap_reward(reward_from_config(cfg.reward, model_cache_dir=cfg.model.cache_dir,
                                                                 device=rt.device, log_dir=out.path,
                                                                 should_stop=lambda: self.stop.requested))
        self.pool = ThreadPoolExecutor(cfg.reward.host_workers) if cfg.reward.host_workers else None
        self.reward_timing = RewardTiming(rt.device, pooled=self.pool is not None)  # scored and hidden seconds
        # how long one of the reward's requests may take by its own timeouts (the rank watch waits that long), kept
        # well below the collective timeout: past it the peers' collective fails first and blames the wrong rank
        self.reward_bound_s = min(request_bound_s(cfg.reward.model_dump()), 0.8 * cfg.distributed.timeout_s)
        # algorithm.advantage_aggregation=gdpo (group algorithms, reward=weighted): the components' weights by key
        gdpo = cfg.algorithm.model_dump().get("advantage_aggregation") == "gdpo"  # a key of the group algorithms only
        self.gdpo_weights = component_weights(cfg.reward) if gdpo else None
        self.global_batch = plan.global_sample_batch
        # each rank trains the samples it drew (training/epoch_data.py): the distributed execution's key
        self.keep_samples_on_rank = plan.keep_samples_on_rank
        self.shape = step_shape(plan)
        self.stepper = Stepper(cfg, rt, self.family.model, self.state, self.events, self.algorithm.stat_names,
                               out.path, report_step=lambda rec: self.report.step(rec),
                               saved_state=lambda: self.checkpoints.saved_state())
        # what an epoch trainer and the algorithm's hooks may use of the run
        self.ctx = EpochContext(cfg, rt, self.family, self.state, self.events, self.stepper, self.shape, self.mixed)
        # what the algorithm scores per image besides the reward (GARDO's auxiliary rewards and features), or None
        self.image_scores = self.algorithm.image_scores(self.ctx)
        with torch.no_grad():
            neg = self.family.encode([""])  # each (1, ...): the unconditional prompt
            # expanded once and materialised here: a view created per epoch would join (and change) the next graph
            expand = lambda n: tuple(rt.shard_batch(c.expand(n, *c.shape[1:]).contiguous()) for c in neg)
            self.uncond_sample = expand(self.global_batch)
            uncond_train = expand(self.shape.train_batch * self.shape.fused)
        rt.sync()
        # the two functions every step runs, compiled once by backends that can (xla.step_compiler)
        autocast = self.ctx.autocast
        self.denoise_step = rt.compile_step(self.family.make_denoise_step(
            autocast, deterministic=self.algorithm.ode_sampling))
        # an SDE window: the steps outside it are the ODE's, a graph of its own (the same for every window position)
        self.ode_step = (rt.compile_step(self.family.make_denoise_step(autocast, deterministic=True))
                         if plan.sde_window is not None else None)
        # an algorithm that trains on the clean samples, not the recorded steps (DiffusionNFT, AWM), brings its own
        # epoch trainer; the others re-score the recorded steps (training/ppo_epoch.py)
        self.epoch_trainer = (self.algorithm.make_epoch_trainer(self.ctx)
                              or PpoEpochTrainer(self.ctx, self.algorithm, uncond_train))
        if self.epoch_trainer.sampling_step is not None:  # DiffusionNFT's ODE solver samples its rollouts
            self.denoise_step = self.epoch_trainer.sampling_step
        if self.keep_samples_on_rank and not isinstance(self.epoch_trainer, PpoEpochTrainer):  # refused at compose
            raise ValueError(f"algorithm={cfg.algorithm.name} trains the whole epoch: distributed.keep_samples_on_rank "
                             "must be false")
        self.checkpoints = CheckpointManager(cfg, rt, out, self.events, self.tree, self.stop, family=self.family,
                                             state=self.state, algorithm=self.algorithm)
        self.report = Reporter(cfg, rt, out, self.events, self.tree, self.algorithm.stat_names)
        # the held-out evaluation (training/evaluation.py): its plan, sampler and reward panel
        self.evaluator = None
        if cfg.evaluation.every_n_epochs:
            from ddpo_tpu.training.evaluation import Evaluator

            self.evaluator = Evaluator(self)

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def start_epoch(self) -> int:
        return self.checkpoints.start_epoch

    def resume(self) -> None:
        self.checkpoints.resume()

    # --- the loop -----------------------------------------------------------------------------------------------
    def fit(self) -> None:
        cfg, rt = self.cfg, self.rt
        self.report.start(self.checkpoints.run_id, self.start_epoch, self.state.layout(), self.global_batch,
                          self.shape.train_timesteps)
        for epoch in range(self.start_epoch, cfg.num_epochs):
            clock = PhaseClock(rt, self.events, epoch)
            if epoch == 0 and self.global_step == 0 and self.evaluation_due(ev.BEFORE_TRAINING):
                with clock.measure("evaluation_before"), rt.compiling("evaluation", epoch, self.events):
                    self.evaluate(ev.BEFORE_TRAINING)  # the "before" of every later evaluation
            with clock.measure("sampling"), rt.compiling("sampling", epoch, self.events), \
                    self.epoch_trainer.sampling_policy():
                sampled = self.sample_epoch(epoch)
            with clock.measure("reward"):
                rewards = self.gather_rewards(epoch, sampled)
            clock.phases["reward"].update(self.reward_timing.take())
            with clock.measure("advantages"):
                samples = self.epoch_samples(epoch, sampled, rewards)
            self.events.emit(ev.PhaseStart(epoch, "training"))
            with clock.measure("training"), rt.compiling("training", epoch, self.events):
                steps = self.train_epoch(epoch, samples)
            self.algorithm.after_training(epoch, steps)  # GARDO: the updates' KL decides the next reset
            del samples
            if self.evaluation_due(epoch):
                with clock.measure("evaluation"), rt.compiling("evaluation", epoch, self.events):
                    self.evaluate(epoch)
            self.end_epoch(epoch, sampled, rewards, steps, clock)
        if self.pool is not None:
            self.pool.shutdown()
        self.report.finish(self.global_step)

    def end_epoch(self, epoch: int, sampled: SampledEpoch, rewards: np.ndarray, steps: list[dict],
                  clock: PhaseClock) -> None:
        """Checkpoint (written, not yet in place), the epoch's outputs, then the commit: a kill before the commit
        redoes the epoch, after it finds every output of the epoch. Then the stop point."""
        stopping = self.checkpoints.stopping()
        saving = self.checkpoints.due(epoch) or stopping
        with clock.measure("checkpoint"):  # the copy to the host and the writes; the commit comes last
            pending = self.checkpoints.save(epoch) if saving else None
        extras = extras_means(sampled.extras)
        self.report.epoch(epoch, self.global_step, sampled.first_images, sampled.prompts, rewards, steps, clock,
                          self.algorithm.epoch_metrics, extras)
        if saving:  # after every output of the epoch: a kill before this line redoes the epoch
            self.checkpoints.commit(epoch, pending)
        elif self.rt.is_main:
            self.out.publish()  # bucket copy of the epoch's files (a checkpoint epoch publishes in its commit)
        self.report.epoch_done(epoch, rewards, steps, clock, extras)
        self.checkpoints.stop_if_requested(epoch, stopping)

    # --- sampling and rewards ---------------------------------------------------------------------------------
    def _score(self, images: np.ndarray, prompts: list[str]) -> Future | RewardScores | tuple:
        """The reward's RewardScores of these images (each with its prompt's metadata), or (RewardScores, the
        algorithm's scores); a Future of it with reward.host_workers (scored while the next batch samples)."""
        metadata = self.prompts.metadata(prompts)  # looked up here: the thread gets its own rows
        fn = lambda i, p, m: score_with(self.reward, i, p, m)
        if self.image_scores is not None:  # (reward, the algorithm's scores) of the same images, in the same thread
            fn = lambda i, p, m: (score_with(self.reward, i, p, m), self.image_scores(i, p))
        fn = self.reward_timing.timed(fn)  # its seconds, and a pool thread's own CUDA stream
        from ddpo_tpu.waits import REWARD, marked, waiting

        if self.pool is None:  # the rank watch names this call when it hangs
            with waiting(REWARD, f"reward.name={self.cfg.reward.name}, {len(images)} images",
                         bound_s=self.reward_bound_s):
                return fn(images, prompts, metadata)
        return self.pool.submit(marked(fn), images, prompts, metadata)

    def _sample_batch(self, prompts: list[str], gen: torch.Generator | None, evaluation: bool = False,
                      sde_window: tuple[int, int] | None = None, noise: tuple | None = None, uncond=None,
                      step=None) -> tuple[Trajectory, Cond, np.ndarray]:
        """One batch: initial latents and per-step noise from `gen` (or `noise`: (init, per-step noise)), the
        trajectory, its images on the host. `evaluation`: the evaluator's step (or `step`: (step, T)) and batch."""
        cfg, rt = self.cfg, self.rt
        if evaluation and step is None:  # the evaluator's sampler
            step, uncond = (self.evaluator.step, self.evaluator.steps), self.evaluator.uncond
        step, T = step or (self.denoise_step, self.family.num_steps)
        B, shape = len(prompts), self.family.latent_shape
        init, noise = noise or (None, None)
        init = torch.randn((B, *shape), generator=gen) if init is None else init
        noise = torch.randn((T, B, *shape), generator=gen) if noise is None else noise
        cond = self.family.encode(prompts)
        traj = sample_trajectory(step, T, cond, self.uncond_sample if uncond is None else uncond, init, noise, rt=rt,
                                 sync_every=cfg.xla.sync_every_n_denoising_steps, window=sde_window,
                                 ode_step=self.ode_step)
        with rt.autocast(self.mixed):
            images = self.family.decode(traj.sample)
        return traj, cond, rt.to_host(images).numpy()  # the one device-to-host copy of this batch

    def sample_epoch(self, epoch: int) -> SampledEpoch:
        cfg, rt = self.cfg, self.rt
        self.events.emit(ev.PhaseStart(epoch, "sampling"))
        prompt_rng = np.random.default_rng(stream_seed(cfg.seed, epoch, PROMPTS))
        noise_gen = torch.Generator().manual_seed(stream_seed(cfg.seed, epoch, NOISE))
        self.family.model.eval()
        out = SampledEpoch([], [], [], [], None)
        n = cfg.sample.num_batches_per_epoch
        for b, prompts in enumerate(self.algorithm.epoch_prompts(self.prompts, n, self.global_batch, prompt_rng)):
            where = (sde_window_at(self.plan.sde_window, self.family.num_steps, cfg.seed, epoch, b)
                     if self.plan.sde_window is not None else None)  # None: all SDE
            traj, cond, images = self._sample_batch(prompts, noise_gen, sde_window=where)
            # the images of this process's rows (all of them unless distributed), scored here
            out.pending_rewards.append(self._score(images, prompts[rt.local_rows(len(prompts))]))
            out.trajectories.append(traj)
            out.conds.append(cond)
            out.prompts.extend(prompts)
            if out.first_images is None:
                out.first_images = images
            if (b + 1) % cfg.xla.sync_every_n_sampling_batches == 0:
                rt.sync()
            self.events.emit(ev.SamplingBatch(epoch, b + 1, n))
            self.checkpoints.stop_if_requested(epoch - 1)
        return out

    def gather_rewards(self, epoch: int, sampled: SampledEpoch) -> np.ndarray:
        """The epoch's rewards (NaN where a reward was not finite and on_nonfinite_reward=skip)."""
        cfg = self.cfg
        if cfg.xla.sync_before_reward_gather:
            self.rt.sync()
        try:
            # per batch, every process's rows in order (distributed: gathered from the ranks)
            from ddpo_tpu.waits import REWARD, pool_activity, waiting

            # the rank watch names this wait when the pool's calls stop moving (each call's start and end is progress)
            with waiting(REWARD, f"reward.name={cfg.reward.name}, epoch {epoch}", since=pool_activity(),
                         bound_s=self.reward_bound_s), self.reward_timing.waiting():
                done = [f.result() if isinstance(f, Future) else f for f in sampled.pending_rewards]
            if self.image_scores is not None:
                sampled.scores = {k: np.concatenate([self.rt.gather_rows(np.asarray(d[1][k])) for d in done])
                                  for k in done[0][1]}
                done = [d[0] for d in done]
            rewards = np.concatenate([self.rt.gather_rows(np.asarray(d.values)) for d in done])
            sampled.extras = gather_extras(self.rt, done)
            if self.gdpo_weights is not None:  # GDPO: the advantages normalise reward=weighted's components alone
                sampled.components = {k: sampled.extras[k] for k in self.gdpo_weights}
        except RewardInterrupted:  # SIGTERM while a remote reward hung: the state as of the previous epoch
            self.checkpoints.stop_if_requested(epoch - 1)
            raise
        bad = ~np.isfinite(rewards)
        if bad.any() and cfg.on_nonfinite_reward == "stop":
            raise NonFinite(f"reward.name={cfg.reward.name} returned {int(bad.sum())} non-finite value(s) in epoch "
                            f"{epoch}: stopped; {self.checkpoints.saved_state()} (on_nonfinite_reward=skip gives "
                            f"those samples zero advantage instead)")
        self.events.emit(ev.RewardsGathered(epoch, float(rewards.mean()), float(rewards.std()), int(bad.sum())))
        return np.where(bad, np.nan, rewards)

    def epoch_samples(self, epoch: int, sampled: SampledEpoch, rewards: np.ndarray) -> EpochSamples:
        """Advantages from the algorithm (zero for non-finite rewards), beside the trajectories on the device, and
        the algorithm's train plan (order and loss weights: GRPO drops zero-advantage samples as flow_grpo)."""
        # per-prompt statistics keyed as the references key them: the tokenizer's decoding of the prompt ids
        key_of = lambda texts: self.family.prompt_keys(texts, self.algorithm.key_tokens)
        self.algorithm.rekey(key_of)  # a tracker restored from a checkpoint keyed by raw text
        keys = key_of(sampled.prompts)
        keep = np.isfinite(rewards)
        adv = np.zeros_like(rewards, dtype=np.float32)
        scores, parts = sampled.scores, sampled.components
        kept = lambda m: {**({"scores": {k: v[m] for k, v in scores.items()}} if scores is not None else {}),
                          **({"components": {k: v[m] for k, v in parts.items()}} if parts is not None else {})}
        if keep.all():
            adv = self.algorithm.advantages(keys, rewards, **kept(keep))
        else:
            adv[keep] = self.algorithm.advantages([p for p, k in zip(keys, keep) if k], rewards[keep], **kept(keep))
        if not np.isfinite(adv).all():
            raise NonFinite(f"non-finite advantages in epoch {epoch}: stopped; {self.checkpoints.saved_state()}")
        # distributed.keep_samples_on_rank: this process trains the samples it drew (training/epoch_data.py)
        own, whole_epoch = self.keep_samples_on_rank, rewards
        rows = drawn_rows(self.rt, len(sampled.trajectories), self.global_batch) if own else slice(None)
        if own:  # the algorithm plans this process's samples (flow_grpo's mask is per process)
            adv, keys, rewards = adv[rows], [keys[i] for i in rows], rewards[rows]
        plan = self.algorithm.train_plan(epoch, adv, keys, rewards)
        weights = plan.weights if plan is not None else np.ones(len(adv), dtype=np.float32)
        # GARDO's gate: over the whole epoch, as its code ranks the gathered rewards, then this process's rows
        gate = self.algorithm.kl_gate(whole_epoch, scores) if scores is not None else None
        return epoch_samples(self.rt, sampled.trajectories, sampled.conds, adv, weights,
                             plan.orders if plan is not None else None, own,
                             gate[rows] if gate is not None else None)

    def evaluation_due(self, epoch: int) -> bool:
        from ddpo_tpu.training.evaluation import evaluation_due

        return evaluation_due(self, epoch)

    def evaluate(self, epoch: int, out_root=None, name: str | None = None) -> dict:
        """The whole evaluation pass (training/evaluation.py) with the current weights (the EMA when kept), written to
        `out_root`/NAME (the run dir's eval/epoch_NNNN or eval/before_training), logged as kind "eval"."""
        from ddpo_tpu.training.evaluation import eval_dir_name

        name = name or eval_dir_name(epoch)
        rec = self.evaluator.run(epoch, Path(out_root or self.out.path / "eval") / name, name)
        if rec is None:  # abandoned for a stop: the checkpoint and the stop come next
            return {}
        images, prompts, rewards = rec.pop("_images"), rec.pop("_prompts"), rec.pop("_rewards")
        if epoch == ev.BEFORE_TRAINING:
            rec["before_training"] = True
        self.report.evaluation(rec, images, prompts, rewards)
        return rec

    # --- training -----------------------------------------------------------------------------------------------
    def train_epoch(self, epoch: int, s: EpochSamples) -> list[dict[str, float]]:
        """The epoch's optimizer steps: the epoch trainer's (training/ppo_epoch.py, or the algorithm's own)."""
        return self.epoch_trainer.train_epoch(epoch, s)
