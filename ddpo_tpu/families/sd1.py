"""Stable Diffusion 1.x: a UNet predicting noise, a CLIP text encoder, the 4-channel VAE, sampled with DDIM whose
steps are Gaussian policies (DDPO, Black et al. 2023)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ddpo_tpu.diffusion.ddim import DDIMTables
from ddpo_tpu.diffusion.sampling import autocast_context, decode_to_uint8, guided_noise_pred, make_denoise_step
from ddpo_tpu.families.base import Cond, ModelFamily, StepScore


class SD1Family(ModelFamily):
    name = "sd1"
    tables: DDIMTables

    def __init__(self, cfg, rt, unet, vae, text_encoder, tokenizer, scheduler):
        self.cfg, self.rt = cfg, rt
        self.model, self.vae, self.text_encoder, self.tokenizer = unet, vae, text_encoder, tokenizer
        self.scheduler = scheduler
        self.tables = DDIMTables.from_scheduler(scheduler, cfg.sample.num_steps, rt.device)
        self.num_steps = self.tables.num_steps
        c = unet.config
        self.latent_shape = (c.in_channels, c.sample_size, c.sample_size)

    @classmethod
    def load(cls, cfg, rt) -> "SD1Family":
        from ddpo_tpu.models.from_config import load_from_config
        from ddpo_tpu.models.lora import make_trainable

        comps = load_from_config(cfg.model)
        make_trainable(comps.unet, cfg.model)  # adapter weights drawn from torch's global generator (seeded)
        return cls(cfg, rt, comps.unet.to(rt.device), comps.vae.to(rt.device), comps.text_encoder.to(rt.device),
                   comps.tokenizer, comps.scheduler)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Cond:
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
        ids = self.rt.shard_batch(ids.to(self.rt.device)) if len(prompts) > 1 else ids.to(self.rt.device)
        return (self.text_encoder(ids)[0],)

    def prompt_keys(self, prompts: list[str], max_length: int) -> list[str]:
        """Per-prompt statistics keys as the references make them: the tokenizer's decoding of the prompt's ids."""
        return decoded_prompts(self.tokenizer, prompts, max_length)

    def schedule(self, num_steps: int) -> DDIMTables:
        if num_steps == self.num_steps:
            return self.tables
        return DDIMTables.from_scheduler(self.scheduler, num_steps, self.rt.device)

    def make_denoise_step(self, autocast, tables: DDIMTables | None = None, deterministic: bool = False):
        unet, tables, s = self.call_denoiser(), tables or self.tables, self.cfg.sample
        if not deterministic:
            assert s.eta is not None  # ddim's key: config/components.py refuses a run that leaves it null
            step = make_denoise_step(unet, tables, eta=s.eta, guidance_scale=s.guidance_scale, autocast=autocast)
            return lambda x, idx, z, cond, uncond: step(x, idx, z, cond[0], uncond[0])

        def ddim_step(x: Tensor, idx: Tensor, z: Tensor, cond: Cond, uncond: Cond):
            with autocast_context(autocast):
                eps = guided_noise_pred(unet, x, tables.timestep_at(idx), cond[0], uncond[0], s.guidance_scale)
            # eta 0: the step is its mean (DDIM's deterministic sampler); a point mass has no log-density
            _, _, mean, _ = tables.step(eps, idx, x, 0.0, noise=z, full=True)
            return mean, torch.zeros(x.shape[0], device=x.device)

        return ddim_step

    def make_score_step(self, autocast):
        unet, tables, s = self.call_denoiser(), self.tables, self.cfg.sample
        detach = self.cfg.train.cfg_detach_uncond  # train time only: sampling has no gradient

        def score_step(x: Tensor, idx: Tensor, x_prev: Tensor, cond: Cond, uncond: Cond | None) -> StepScore:
            with autocast_context(autocast):
                eps = guided_noise_pred(unet, x, tables.timestep_at(idx), cond[0],
                                        uncond[0] if uncond is not None else None, s.guidance_scale, detach)
            _, log_prob, mean, std = tables.step(eps.float(), idx, x, s.eta, prev_sample=x_prev, full=True)
            return StepScore(log_prob, mean, std)

        return score_step

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        return decode_to_uint8(self.vae, latents)

    def reference(self):
        return adapters_off(self.model, self.cfg.model)


@contextlib.contextmanager
def adapters_off(model, model_cfg):
    """The model as it was before training: its LoRA adapters off (no second copy of the weights)."""
    if not model_cfg.lora.enabled:
        raise ValueError("the reference policy is the model with its LoRA adapter off: needs model.lora.enabled=true")
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def decoded_prompts(tokenizer, prompts: list[str], max_length: int) -> list[str]:
    """tokenizer(prompts, padding max_length, truncation) decoded without special tokens: the key ddpo-pytorch
    (max_length 77) and flow_grpo (256) give a prompt. A CLIP tokenizer lower-cases, normalises whitespace and cuts at
    max_length tokens, so "A  Cat" and "a cat" are one prompt to their stat trackers."""
    if not prompts:
        return []
    ids = tokenizer(list(prompts), padding="max_length", max_length=max_length, truncation=True).input_ids
    return tokenizer.batch_decode(ids, skip_special_tokens=True)
