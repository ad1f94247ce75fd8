"""FLUX.2-klein: an MMDiT predicting velocity on packed, batch-norm-normalised 2x2 latents, conditioned on three hidden
states of Qwen3 over the chat-templated prompt, sampled with Flow-GRPO's SDE (Flow-Factory's "Flow-SDE" dynamics,
the same step as SD 3's, diffusion/flow.py) on Flux2KleinPipeline's schedule (sigmas shifted by
``compute_empirical_mu``, which grows with the image's token count and the step count).

Guidance is true CFG as Flux2KleinPipeline and Flow-Factory's Flux2KleinAdapter apply it: an unconditional pass on the
negative prompt "" beside the conditional one, ``uncond + g (cond - uncond)``, at sample.guidance_scale > 1 (the base
checkpoints: Flow-Factory's klein-base examples sample at 4.0); at 1 one conditional pass (the step-distilled klein
checkpoints: Flow-Factory's klein examples sample at 1.0, 4 steps). A checkpoint whose model_index.json says
``is_distilled`` never runs the unconditional pass (the pipeline ignores the scale for those). models/flux2.py holds
the pipeline's pieces and says what differs from FLUX.1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.families.base import Cond, checkpoint_source, encode_distinct
from ddpo_tpu.families.flow import FlowFamily
from ddpo_tpu.families.sd1 import decoded_prompts

if TYPE_CHECKING:  # annotations only: the models module is imported where it is used
    from ddpo_tpu.models.flux2 import Flux2Components

TINY_PIXELS = 32  # the tiny build's images (8 x 8 latents, 16 packed tokens)


class Flux2Family(FlowFamily):
    """A flow family with FLUX.2-klein's conditioning, packing, schedule and guided velocity: the sampling step, the
    score step (Flow-GRPO's step on ``FlowTables``), the forward-process velocity (DiffusionNFT, AWM) and the
    reference policy (the adapter off) are FlowFamily's."""

    name = "flux2"
    c: Flux2Components

    def __init__(self, cfg, rt, components):
        from ddpo_tpu.models.flux2 import TEXT_TOKENS, latent_ids, text_ids

        self.cfg, self.rt, self.c = cfg, rt, components
        self.model = components.transformer
        self.dtype = self.model.dtype
        factor = components.vae_scale_factor
        # null: the tiny build's 32 px, else the pipeline's default (default_sample_size 128 latent pixels: 1024 px)
        pixels = cfg.model.resolution or (TINY_PIXELS if cfg.model.builder is not None else 128 * factor)
        # Flux2KleinPipeline.prepare_latents: a side of 2 * (pixels // (factor * 2)) latent pixels, h = half of it
        self.side = int(pixels) // (factor * 2)
        self.latent_size = 2 * self.side
        self.latent_shape = (self.side * self.side, int(self.model.config.in_channels))  # packed: (tokens, 4C)
        self.tables = self.make_tables(cfg.sample.num_steps)
        self.num_steps = self.tables.num_steps
        self.img_ids = latent_ids(self.side, self.side, rt.device)
        self.txt_ids = text_ids(TEXT_TOKENS, rt.device)

    PARTS = ("transformer", "vae", "text_encoder")  # moved to the device by FlowFamily.load

    @staticmethod
    def load_components(m, dtype):
        from ddpo_tpu.models.flux2 import ensure_tiny_flux2, load_flux2

        source, revision, local = checkpoint_source(m, ensure_tiny_flux2)
        return load_flux2(source, revision=revision, local_files_only=local, dtype=dtype)

    def make_tables(self, num_steps: int) -> FlowTables:
        from ddpo_tpu.models.flux2 import flux2_tables

        return flux2_tables(self.c.scheduler, num_steps, self.latent_shape[0], self.rt.device)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Cond:
        from ddpo_tpu.models.flux2 import encode_prompts_flux2

        embeds, = encode_distinct(prompts, lambda ps: (encode_prompts_flux2(self.c, ps, self.rt.device),), self.rt)
        if len(prompts) > 1:
            embeds = self.rt.shard_batch(embeds)
        return (embeds,)

    def prompt_keys(self, prompts: list[str], max_length: int) -> list[str]:
        """Per-prompt statistics keys: the Qwen tokenizer's decoding of the prompt's ids (as Qwen-Image's)."""
        return decoded_prompts(self.c.tokenizer, prompts, max_length)

    def guided(self, uncond: Cond | None) -> bool:
        """Whether a step runs CFG: an unconditional conditioning, a scale above 1 and a checkpoint that is not
        step-distilled (Flux2KleinPipeline.do_classifier_free_guidance)."""
        return uncond is not None and float(self.cfg.sample.guidance_scale) > 1.0 and not self.c.is_distilled

    def velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                 detach_uncond: bool = False) -> Tensor:
        from ddpo_tpu.models.flux2 import flux2_velocity

        guided = self.guided(uncond)
        neg = uncond[0] if guided and uncond is not None else None  # guided implies uncond; mypy can't see that
        return flux2_velocity(self.call_denoiser(), x.to(self.dtype), (tables or self.tables).timestep_at(idx),
                              cond[0], self.img_ids, self.txt_ids, neg,
                              float(self.cfg.sample.guidance_scale) if guided else 1.0, detach_uncond)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        from ddpo_tpu.models.flux2 import decode_flux2

        images = decode_flux2(self.c.vae, latents, self.side, self.side)
        return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
