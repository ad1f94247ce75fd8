"""Stable Diffusion 3 / 3.5: an MMDiT transformer predicting velocity, two CLIP text encoders (and optionally T5),
the 16-channel VAE with its shift and scaling factors, sampled with Flow-GRPO's SDE whose steps are Gaussian
policies (Liu et al. 2025)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.families.base import Cond, checkpoint_source
from ddpo_tpu.families.flow import FlowFamily

if TYPE_CHECKING:  # annotations only: the models module is imported where it is used
    from ddpo_tpu.models.sd3 import SD3Components

T5_TOKENS = 128  # flow_grpo's max_sequence_length for the T5 part of the prompt (zeros without T5)


class SD3Family(FlowFamily):
    name = "sd3"
    c: SD3Components

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

    def velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                 detach_uncond: bool = False) -> Tensor:
        from ddpo_tpu.models.sd3 import sd3_velocity

        tables = tables or self.tables
        neg = uncond if uncond is not None else (None, None)
        return sd3_velocity(self.call_denoiser(), x.to(self.dtype), tables.timestep_at(idx).to(self.dtype), cond[0],
                            cond[1], neg[0], neg[1], self.cfg.sample.guidance_scale if uncond is not None else 1.0,
                            detach_uncond)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        from ddpo_tpu.models.sd3 import decode_sd3

        images = decode_sd3(self.c.vae, latents)
        return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
