"""Z-Image (Turbo and base): a single-stream DiT predicting the negative velocity on FLUX.1's 16-channel latents,
conditioned on a Qwen3 model's second-to-last hidden states of the chat-templated prompt (its real tokens only),
sampled with Flow-GRPO's SDE: Flow-Factory's "Flow-SDE" dynamics (src/flow_factory/scheduler/
flow_match_euler_discrete.py:342-371 at a0b2bc5a), the step diffusion/flow.py already has, on ZImagePipeline's
schedule (linspace(1, 1/N, N) sigmas under the checkpoint scheduler's shift). models/z_image.py has the details.

Turbo and base differ in configuration only (conf/model/z_image_turbo.yaml, z_image.yaml): Turbo is guidance-distilled
and samples without guidance in few steps (Z-Image's guidance_scale 0 = sample.guidance_scale 1); base samples with
Z-Image's guidance 4 (sample.guidance_scale 5, the usual CFG form) in more steps. The unconditional prompt is "", as
ZImagePipeline's and Flow-Factory's default negative prompt.

On a runtime that compiles graphs (torch_xla) the velocity goes through models/z_image.py::z_forward_fixed on the
padded prompt batch and its mask (one shape for every set of prompt lengths, equal to diffusers' list forward); eager
runtimes call the transformer on the caption lists as ZImagePipeline does.
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
    from ddpo_tpu.models.z_image import ZImageComponents

TINY_PIXELS = 32  # the tiny build's images (8 x 8 latents, 16 image tokens)
DEFAULT_PIXELS = 1024  # ZImagePipeline's default height and width


class ZImageFamily(FlowFamily):
    """A flow family with Z-Image's conditioning, schedule and (negated, guided) velocity; the sampling step, the
    score step, the forward-process velocity and the reference policy are FlowFamily's."""

    name = "z_image"
    c: ZImageComponents
    PARTS = ("transformer", "vae", "text_encoder")  # moved to the device by FlowFamily.load

    def __init__(self, cfg, rt, components):
        self.cfg, self.rt, self.c = cfg, rt, components
        self._caption_memo: list[tuple[tuple[Tensor, Tensor], list[Tensor]]] = []  # _captions
        self.model = components.transformer
        self.dtype = self.model.dtype
        # the fixed-shape forward (models/z_image.py::z_forward_fixed) where torch_xla traces graphs: it calls the
        # transformer's submodules, which a data-parallel wrapper's forward would not see (torchrun: DDP's gradient
        # reduction, FSDP2's gathers), and torch.compile there takes each caption length as it comes
        self.fixed_shapes = cfg.tpu_topology.spec.torch_xla
        if self.fixed_shapes:
            from ddpo_tpu.models.z_image import rope_tables_to

            rope_tables_to(self.model, rt.device)  # not host constants in the compiled graphs
        factor = components.vae_scale_factor
        pixels = cfg.model.resolution or (TINY_PIXELS if cfg.model.builder is not None else DEFAULT_PIXELS)
        # ZImagePipeline.prepare_latents: a latent side a multiple of 2 (the transformer's 2x2 patches)
        side = 2 * (int(pixels) // (factor * 2))
        self.latent_shape = (int(self.model.config.in_channels), side, side)
        self.tokens = (side // 2) ** 2
        self.tables = self.make_tables(cfg.sample.num_steps)
        self.num_steps = self.tables.num_steps

    @staticmethod
    def load_components(m, dtype):
        from ddpo_tpu.models.z_image import ensure_tiny_z_image, load_z_image

        source, revision, local = checkpoint_source(m, ensure_tiny_z_image)
        return load_z_image(source, revision=revision, local_files_only=local, dtype=dtype)

    def make_tables(self, num_steps: int) -> FlowTables:
        from ddpo_tpu.models.z_image import z_tables

        return z_tables(self.c.scheduler, num_steps, self.tokens, self.rt.device)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Cond:
        from ddpo_tpu.models.z_image import encode_prompts_z

        states, mask = encode_distinct(prompts, lambda ps: encode_prompts_z(self.c, ps, self.rt.device), self.rt)
        if len(prompts) > 1:
            states, mask = self.rt.shard_batch(states), self.rt.shard_batch(mask)
        return states, mask

    def prompt_keys(self, prompts: list[str], max_length: int) -> list[str]:
        """Per-prompt statistics keys: the Qwen tokenizer's decoding of the prompt's ids."""
        return decoded_prompts(self.c.tokenizer, prompts, max_length)

    def velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                 detach_uncond: bool = False) -> Tensor:
        from ddpo_tpu.models.z_image import z_velocity, z_velocity_fixed

        tables = tables or self.tables
        if self.fixed_shapes:  # one shape for every set of prompt lengths (models/z_image.py::z_forward_fixed)
            neg_fixed = None if uncond is None else (uncond[0], uncond[1])
            scale = self.cfg.sample.guidance_scale if uncond is not None else 1.0
            return z_velocity_fixed(self.call_denoiser(), x.float(), tables.timestep_at(idx), (cond[0], cond[1]),
                                    neg_fixed, scale, detach_uncond)
        neg = self._captions(uncond) if uncond is not None else None
        return z_velocity(self.call_denoiser(), x.float(), tables.timestep_at(idx), self._captions(cond), neg,
                          self.cfg.sample.guidance_scale if uncond is not None else 1.0, detach_uncond, self.dtype)

    def _captions(self, cond: Cond) -> list[Tensor]:
        """The caption list of (states, mask), cut once per conditioning rather than at every step: the mask's
        selection has a data-dependent shape, so each cut reads the mask on the host (a sync per denoising step on
        an accelerator). Kept for the last two conditionings (the prompt's and the negative's), by identity: the
        tensors themselves are held, so a new tensor never matches an old entry."""
        from ddpo_tpu.models.z_image import caption_list

        states, mask = cond
        for key, caps in self._caption_memo:
            if key[0] is states and key[1] is mask:
                return caps
        caps = caption_list(states, mask)
        self._caption_memo = [((states, mask), caps), *self._caption_memo][:2]
        return caps

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        from ddpo_tpu.models.z_image import decode_z_image

        images = decode_z_image(self.c.vae, latents)
        return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
