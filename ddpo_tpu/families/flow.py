"""The flow-matching families' common base (SD 3 / 3.5, FLUX.1, Wan 2.1, Qwen-Image): a velocity model on the
sampler's FlowTables (diffusion/flow.py). A family says how it loads its parts, encodes prompts, calls its denoiser
for a (guided) velocity, and decodes; the sampling step, the re-scored step, the forward-process velocity
(DiffusionNFT, AWM), the schedules and the reference policy (the adapter off) are written here once.

`velocity` is the public call every flow algorithm uses (the loop's steps here, DiffusionNFT's rollout solver in
algorithms/nft_rollout.py); `policy_step` is the sampler's Gaussian step with its log-prob (Flow-GRPO's SDE or CPS
step; Wan overrides it with flow_grpo's Wan step)."""

from __future__ import annotations

import abc
from typing import Protocol

import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.diffusion.sampling import autocast_context
from ddpo_tpu.families.base import Cond, ModelFamily, StepScore
from ddpo_tpu.families.sd1 import adapters_off, decoded_prompts


class FlowComponents(Protocol):
    """What FlowFamily itself reads of a family's loaded parts (each family declares its own class: FluxComponents,
    SD3Components, ...). Read-only members, so a family's narrower field types satisfy it."""

    @property
    def scheduler(self) -> object: ...

    @property
    def tokenizer(self) -> object: ...


class FlowFamily(ModelFamily):
    PARTS: tuple[str, ...] = ()  # the pipeline's parts `load` moves to the device
    c: FlowComponents            # the loaded pipeline parts (load_components'), set at construction
    tables: FlowTables
    dtype: torch.dtype

    @abc.abstractmethod
    def __init__(self, cfg, rt, components) -> None:
        """Every flow family is built from the run config, the runtime and its loaded parts (what `load` calls)."""

    @classmethod
    def load(cls, cfg, rt) -> "FlowFamily":
        from ddpo_tpu.models.lora import make_trainable

        m = cfg.model
        comps = cls.load_components(m, torch.bfloat16 if m.dtype == "bfloat16" else torch.float32)
        make_trainable(comps.transformer, m)  # adapter weights drawn from torch's global generator (seeded)
        for name in cls.PARTS:
            part = getattr(comps, name, None)
            if part is not None:
                setattr(comps, name, part.to(rt.device))
        return cls(cfg, rt, comps)

    @staticmethod
    @abc.abstractmethod
    def load_components(m, dtype):
        """The pipeline's parts from the model config: its local build or its checkpoint, through from_pretrained."""

    @abc.abstractmethod
    def velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                 detach_uncond: bool = False) -> Tensor:
        """The denoiser's velocity at latents `x` and schedule step `idx` (on `tables`, default the run's),
        classifier-free guided with sample.guidance_scale when `uncond` is given (`detach_uncond`: no gradient
        through its half)."""

    def policy_step(self, tables: FlowTables, v: Tensor, idx: Tensor, x: Tensor, noise: Tensor | None = None,
                    prev_sample: Tensor | None = None):
        """The sampler's stochastic step: (x_prev, log_prob, mean, std); given `prev_sample`, its log-prob there."""
        s = self.cfg.sample
        # flow_sde's keys: config/components.py refuses a run whose sampler needs them and leaves them null
        assert s.noise_level is not None and s.sde_type is not None
        return tables.step(v, idx, x, s.noise_level, sde_type=s.sde_type, noise=noise, prev_sample=prev_sample)

    def make_tables(self, num_steps: int) -> FlowTables:
        """The schedule of `num_steps` steps (FLUX and Qwen-Image shift it by their token count)."""
        return FlowTables.from_scheduler(self.c.scheduler, num_steps, self.rt.device)

    def schedule(self, num_steps: int) -> FlowTables:
        return self.tables if num_steps == self.num_steps else self.make_tables(num_steps)

    def make_denoise_step(self, autocast, tables: FlowTables | None = None, deterministic: bool = False):
        tables = tables or self.tables

        def denoise_step(x: Tensor, idx: Tensor, z: Tensor, cond: Cond, uncond: Cond):
            with autocast_context(autocast):
                v = self.velocity(x, idx, cond, uncond, tables)
            if deterministic:  # the ODE (the SDE at noise level 0); a point mass has no log-density
                return tables.ode_step(v.float(), idx, x), torch.zeros(x.shape[0], device=x.device)
            prev, log_prob, _, _ = self.policy_step(tables, v.float(), idx, x, noise=z)
            return prev, log_prob

        return denoise_step

    def make_score_step(self, autocast):
        detach = self.cfg.train.cfg_detach_uncond  # train time only: sampling has no gradient

        def score_step(x: Tensor, idx: Tensor, x_prev: Tensor, cond: Cond, uncond: Cond | None) -> StepScore:
            with autocast_context(autocast):
                v = self.velocity(x, idx, cond, uncond, detach_uncond=detach)
            _, log_prob, mean, std = self.policy_step(self.tables, v.float(), idx, x, prev_sample=x_prev)
            return StepScore(log_prob, mean, std)

        return score_step

    def make_velocity(self, autocast):
        def forward_velocity(x0: Tensor, noise: Tensor, idx: Tensor, cond: Cond) -> tuple[Tensor, Tensor, Tensor]:
            sigma = self.tables.sigmas_at(idx)[0].reshape(-1, *([1] * (x0.dim() - 1)))
            xt = (1 - sigma) * x0.float() + sigma * noise.float()
            with autocast_context(autocast):
                v = self.velocity(xt, idx, cond, None)
            return v.float(), xt, sigma

        return forward_velocity

    def prompt_keys(self, prompts: list[str], max_length: int) -> list[str]:
        """Per-prompt statistics keys as flow_grpo makes them: tokenizers[0] (CLIP-L) decoding the prompt's ids."""
        return decoded_prompts(self.c.tokenizer, prompts, max_length)

    def reference(self):
        return adapters_off(self.model, self.cfg.model)


__all__ = ["FlowComponents", "FlowFamily"]
