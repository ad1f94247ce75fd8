"""Qwen-Image: an MMDiT predicting velocity on packed 2x2 latents, conditioned on Qwen2.5-VL's hidden states of the
chat-templated prompt (with a mask: prompts are padded), sampled with Flow-GRPO's SDE (the same step as SD 3's,
diffusion/flow.py; flow_grpo's Qwen-Image code calls sd3_sde_with_logprob's step) on QwenImagePipeline's schedule
(sigmas shifted by mu, which grows with the image's token count).

Guidance is flow_grpo's true CFG: both passes in one batch and the guided velocity rescaled per token to the
conditional one's norm (models/qwen_image.py::qwen_velocity); at sample.guidance_scale 1 one conditional pass. The
unconditional prompt is " " (flow_grpo's negative prompt for Qwen-Image): the loop asks for "" and ``encode`` reads
an empty prompt as " ".

flow_grpo's Qwen-Image sampler has no noise on its last step when it has no SDE window (its window is then (0, T - 1)):
``sample.sde_window`` fixed at start 0 with size T - 1 is that sampler here (conf/experiment/qwen_image_grpo_smoke).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.families.base import Cond, checkpoint_source, encode_distinct
from ddpo_tpu.families.sd1 import decoded_prompts
from ddpo_tpu.families.flow import FlowFamily

if TYPE_CHECKING:  # annotations only: the models module is imported where it is used
    from ddpo_tpu.models.qwen_image import QwenImageComponents

TINY_PIXELS = 32  # the tiny build's images (8 x 8 latents, 16 packed tokens)
PROMPT_KEY_TOKENS = 256  # train_qwenimage.py: per-prompt statistics keys are the tokenizer's decoding at max_length 256


class QwenImageFamily(FlowFamily):
    """A flow family with Qwen-Image's conditioning, packing, schedule and guided velocity: the sampling step, the
    score step (Flow-GRPO's step on ``FlowTables``), the forward-process velocity (DiffusionNFT) and the reference
    policy (the adapter off) are FlowFamily's."""

    name = "qwen_image"
    c: QwenImageComponents

    def __init__(self, cfg, rt, components):
        from ddpo_tpu.models.qwen_image import img_shapes, rope_tables_to

        self.cfg, self.rt, self.c = cfg, rt, components
        self.model = components.transformer
        rope_tables_to(self.model, rt.device)
        self.dtype = self.model.dtype
        factor = components.vae_scale_factor
        # null: the tiny build's 32 px, else QwenImagePipeline's default (default_sample_size 128 latent pixels)
        pixels = cfg.model.resolution or (TINY_PIXELS if cfg.model.builder is not None else 128 * factor)
        # QwenImagePipeline.prepare_latents: a latent side a multiple of 2 (the packing)
        self.latent_size = 2 * (int(pixels) // (factor * 2))
        side = self.latent_size // 2
        self.latent_shape = (side * side, int(self.model.config.in_channels))  # packed: (tokens, 4 x 16)
        self.tables = self.make_tables(cfg.sample.num_steps)
        self.num_steps = self.tables.num_steps
        self.shapes = lambda batch: img_shapes(batch, side, side)

    PARTS = ("transformer", "vae", "text_encoder")  # moved to the device by FlowFamily.load

    @staticmethod
    def load_components(m, dtype):
        from ddpo_tpu.models.qwen_image import ensure_tiny_qwen_image, load_qwen_image

        source, revision, local = checkpoint_source(m, ensure_tiny_qwen_image)
        return load_qwen_image(source, revision=revision, local_files_only=local, dtype=dtype)

    def make_tables(self, num_steps: int) -> FlowTables:
        from ddpo_tpu.models.flux import flux_tables

        # QwenImagePipeline sets the schedule as FluxPipeline (linspace(1, 1/N, N), mu from the token count): the
        # scheduler's own config (exponential shift, shift_terminal) does the rest inside set_timesteps
        return flux_tables(self.c.scheduler, num_steps, self.latent_shape[0], self.rt.device)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Cond:
        from ddpo_tpu.models.qwen_image import NEGATIVE_PROMPT, encode_prompts_qwen

        prompts = [p or NEGATIVE_PROMPT for p in prompts]
        embeds, mask = encode_distinct(prompts, lambda ps: encode_prompts_qwen(self.c, ps, self.rt.device), self.rt)
        if len(prompts) > 1:
            embeds, mask = self.rt.shard_batch(embeds), self.rt.shard_batch(mask)
        return embeds, mask

    def prompt_keys(self, prompts: list[str], max_length: int) -> list[str]:
        """Per-prompt keys as train_qwenimage.py makes them: the Qwen tokenizer's decoding of the prompt's ids padded
        and cut to 256 tokens."""
        return decoded_prompts(self.c.tokenizer, prompts, PROMPT_KEY_TOKENS)

    def velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                 detach_uncond: bool = False) -> Tensor:
        from ddpo_tpu.models.qwen_image import qwen_velocity

        neg = uncond if uncond is not None else (None, None)
        return qwen_velocity(self.call_denoiser(), x.to(self.dtype), (tables or self.tables).timestep_at(idx),
                             cond[0], cond[1], self.shapes(x.shape[0]), neg[0], neg[1],
                             self.cfg.sample.guidance_scale if uncond is not None else 1.0, detach_uncond)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        from ddpo_tpu.models.qwen_image import decode_qwen_image

        images = decode_qwen_image(self.c.vae, latents, self.latent_size, self.latent_size)
        return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
