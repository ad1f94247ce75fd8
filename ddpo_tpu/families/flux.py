"""FLUX.1: a guidance-distilled MMDiT predicting velocity on packed 2x2 latents, conditioned on T5-XXL's token
sequence and CLIP-L's pooled vector, sampled with Flow-GRPO's SDE (the same step as SD 3's, diffusion/flow.py) on
FluxPipeline's schedule (sigmas shifted by mu, which grows with the image's token count).

Guidance is an input (the guidance embedding reads sample.guidance_scale): one transformer pass per step, at sampling
and at training, as flow_grpo's train_flux.py. The loop hands every step an unconditional conditioning; this family
ignores it (its spec says guidance="embedded" and the rules keep train.cfg false).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.families.base import Cond, checkpoint_source
from ddpo_tpu.families.flow import FlowFamily

if TYPE_CHECKING:  # annotations only: the models module is imported where it is used
    from ddpo_tpu.models.flux import FluxComponents

T5_TOKENS = 128  # flow_grpo's max_sequence_length for FLUX's T5 prompt (train_flux.py compute_text_embeddings)


class FluxFamily(FlowFamily):
    """A flow family with FLUX's conditioning, packing, schedule and one-pass velocity: the sampling step, the score
    step (Flow-GRPO's step on ``FlowTables``), the per-prompt keys (CLIP-L's decoding, as train_flux.py) and the
    reference policy (the adapter off) are FlowFamily's."""

    name = "flux"
    c: FluxComponents
    guidance_embeds: bool

    def __init__(self, cfg, rt, components):
        from ddpo_tpu.models.flux import latent_image_ids, text_ids

        self.cfg, self.rt, self.c = cfg, rt, components
        self.model = components.transformer
        self.dtype = self.model.dtype
        pixels = cfg.model.resolution or int(components.vae.config.sample_size)
        # FluxPipeline.prepare_latents: a latent side a multiple of 2 (the packing)
        self.latent_size = 2 * (pixels // (components.vae_scale_factor * 2))
        tokens = (self.latent_size // 2) ** 2
        channels = int(self.model.config.in_channels)  # 4 x the VAE's latent channels
        # a guidance-distilled checkpoint reads the scale through its guidance embedding (read once: the config is
        # fixed; nn.Module's attribute type hides the transformer's `config`)
        self.guidance_embeds = bool(self.model.config.guidance_embeds)
        self.latent_shape = (tokens, channels)          # packed: what the sampler and trainer hold
        self.tables = self.make_tables(cfg.sample.num_steps)
        self.num_steps = self.tables.num_steps
        self.img_ids = latent_image_ids(self.latent_size, self.latent_size, rt.device, self.dtype)
        self.txt_ids = text_ids(T5_TOKENS, rt.device, self.dtype)

    PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2")  # moved to the device by FlowFamily.load

    @staticmethod
    def load_components(m, dtype):
        from ddpo_tpu.models.flux import ensure_tiny_flux, load_flux

        source, revision, local = checkpoint_source(m, ensure_tiny_flux)
        return load_flux(source, revision=revision, local_files_only=local, dtype=dtype)

    def make_tables(self, num_steps: int) -> FlowTables:
        from ddpo_tpu.models.flux import flux_tables

        return flux_tables(self.c.scheduler, num_steps, self.latent_shape[0], self.rt.device)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Cond:
        from ddpo_tpu.models.flux import encode_prompts_flux

        embeds, pooled = encode_prompts_flux(self.c, prompts, self.rt.device, max_sequence_length=T5_TOKENS)
        if len(prompts) > 1:
            embeds, pooled = self.rt.shard_batch(embeds), self.rt.shard_batch(pooled)
        return embeds, pooled

    def velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                 detach_uncond: bool = False) -> Tensor:
        """The one guided pass; `uncond` (which the loop always hands the sampling step) is ignored: train.cfg and
        train.cfg_detach_uncond are false for this family (config/components.py)."""
        from ddpo_tpu.models.flux import flux_velocity

        x = x.to(self.dtype)
        guidance = None
        if self.guidance_embeds:  # the scale as the embedding's input, float32 as the pipeline
            guidance = torch.full((x.shape[0],), float(self.cfg.sample.guidance_scale), device=x.device)
        return flux_velocity(self.call_denoiser(), x, (tables or self.tables).timestep_at(idx), guidance, cond[0],
                             cond[1], self.img_ids, self.txt_ids)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        from ddpo_tpu.models.flux import decode_flux

        images = decode_flux(self.c.vae, latents, self.latent_size, self.latent_size)
        return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
