"""Stable Diffusion 3 / 3.5: an MMDiT transformer predicting velocity, two CLIP text encoders (and optionally T5),
the 16-channel VAE with its shift and scaling factors, sampled with Flow-GRPO's SDE whose steps are Gaussian
policies (Liu et al. 2025)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.families.base import Cond, ModelFamily, StepScore, checkpoint_source
from ddpo_tpu.families.sd1 import adapters_off, decoded_prompts

T5_TOKENS = 128  # flow_grpo's max_sequence_length for the T5 part of the prompt (zeros without T5)


class SD3Family(ModelFamily):
    name = "sd3"

    def __init__(self, cfg, rt, components):
        self.cfg, self.rt, self.c = cfg, rt, components
        self.model = components.transformer
        self.tables = FlowTables.from_scheduler(components.scheduler, cfg.sample.num_steps, rt.device)
        self.num_steps = self.tables.num_steps
        tc = self.model.config
        size = (cfg.model.resolution // components.vae_scale_factor if cfg.model.resolution else tc.sample_size)
        self.latent_shape = (tc.in_channels, size, size)
        self.dtype = self.model.dtype

    PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")  # moved to the device

    @classmethod
    def load(cls, cfg, rt) -> "SD3Family":
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
    def load_components(m, dtype):
        """The pipeline's parts from the model config: its local build or its checkpoint, through from_pretrained."""
        from ddpo_tpu.models.sd3 import ensure_tiny_sd3, load_sd3

        source, revision, local = checkpoint_source(m, ensure_tiny_sd3)
        return load_sd3(source, revision=revision, local_files_only=local, dtype=dtype, load_t5=m.text_encoder_3)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Cond:
        from ddpo_tpu.models.sd3 import encode_prompts_sd3

        embeds, pooled = encode_prompts_sd3(self.c, prompts, self.rt.device, max_sequence_length=T5_TOKENS)
        if len(prompts) > 1:
            embeds, pooled = self.rt.shard_batch(embeds), self.rt.shard_batch(pooled)
        return embeds, pooled

    def _velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                  detach_uncond: bool = False) -> Tensor:
        from ddpo_tpu.models.sd3 import sd3_velocity

        tables = tables or self.tables
        neg = uncond if uncond is not None else (None, None)
        return sd3_velocity(self.call_denoiser(), x.to(self.dtype), tables.timestep_at(idx).to(self.dtype), cond[0],
                            cond[1], neg[0], neg[1], self.cfg.sample.guidance_scale if uncond is not None else 1.0,
                            detach_uncond)

    def make_denoise_step(self, autocast, tables: FlowTables | None = None, deterministic: bool = False):
        s = self.cfg.sample
        tables = tables or self.tables

        def denoise_step(x: Tensor, idx: Tensor, z: Tensor, cond: Cond, uncond: Cond):
            with autocast() if autocast is not None else contextlib.nullcontext():
                v = self._velocity(x, idx, cond, uncond, tables)
            if deterministic:  # the ODE (flow_grpo's SDE at noise_level 0); a point mass has no log-density
                return tables.ode_step(v.float(), idx, x), torch.zeros(x.shape[0], device=x.device)
            prev, log_prob, _, _ = tables.step(v.float(), idx, x, s.noise_level, sde_type=s.sde_type, noise=z)
            return prev, log_prob

        return denoise_step

    def prompt_keys(self, prompts: list[str], max_length: int) -> list[str]:
        """Per-prompt statistics keys as flow_grpo makes them: tokenizers[0] (CLIP-L) decoding the prompt's ids."""
        return decoded_prompts(self.c.tokenizer, prompts, max_length)

    def schedule(self, num_steps: int) -> FlowTables:
        if num_steps == self.num_steps:
            return self.tables
        return FlowTables.from_scheduler(self.c.scheduler, num_steps, self.rt.device)

    def make_score_step(self, autocast):
        s, detach = self.cfg.sample, self.cfg.train.cfg_detach_uncond  # train time only: sampling has no gradient

        def score_step(x: Tensor, idx: Tensor, x_prev: Tensor, cond: Cond, uncond: Cond | None) -> StepScore:
            with autocast() if autocast is not None else contextlib.nullcontext():
                v = self._velocity(x, idx, cond, uncond, detach_uncond=detach)
            _, log_prob, mean, std = self.tables.step(v.float(), idx, x, s.noise_level, sde_type=s.sde_type,
                                                      prev_sample=x_prev)
            return StepScore(log_prob, mean, std)

        return score_step

    def make_velocity(self, autocast):
        def velocity(x0: Tensor, noise: Tensor, idx: Tensor, cond: Cond) -> tuple[Tensor, Tensor, Tensor]:
            sigma = self.tables.sigmas_at(idx)[0].reshape(-1, *([1] * (x0.dim() - 1)))
            xt = (1 - sigma) * x0.float() + sigma * noise.float()
            with autocast() if autocast is not None else contextlib.nullcontext():
                v = self._velocity(xt, idx, cond, None)
            return v.float(), xt, sigma

        return velocity

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        from ddpo_tpu.models.sd3 import decode_sd3

        images = decode_sd3(self.c.vae, latents)
        return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)

    def reference(self):
        return adapters_off(self.model, self.cfg.model)
