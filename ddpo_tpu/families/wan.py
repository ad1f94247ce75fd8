"""Wan 2.1 text-to-video: a 3-D DiT predicting flow velocity on video latents (C, frames, h, w), conditioned on UMT5's
token sequence, decoded by the causal video VAE, sampled with Flow-GRPO's Wan SDE (``diffusion/wan_sde.py``) on the
UniPC scheduler's flow sigmas, as yifan123/flow_grpo's ``scripts/train_wan2_1.py`` (at 9745241).

Everything downstream of the family is the image loop's: trajectories are (B, T + 1, C, f, h, w), the step's
log-prob is a mean over all latent elements (frames included), GRPO's KL compares the step means. What differs:
``decode`` returns uint8 videos (B, F, H, W, 3); ``wrap_reward`` makes an image reward score every frame and reduce
over frames by its ``frame_reduction`` key, and passes a video reward the videos (``rewards/video.py``); the run's
samples are written as mp4 files with a contact sheet (``RunDir.save_videos``).

Guidance is classifier-free with two transformer passes (conditional, then unconditional), as flow_grpo's Wan
pipeline and compute_log_prob do; the unconditional prompt is "" encoded like any prompt.
"""

from __future__ import annotations


from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.diffusion.wan_sde import wan_sde_step
from ddpo_tpu.families.base import Cond, checkpoint_source, encode_distinct
from ddpo_tpu.families.sd1 import decoded_prompts
from ddpo_tpu.families.flow import FlowFamily

if TYPE_CHECKING:  # annotations only: the models module is imported where it is used
    from ddpo_tpu.models.wan import WanComponents


def video_size(model, builder_frame, default_frame) -> tuple[int, int, int]:
    """(frames, height, width) a model config samples: model.num_frames frames of its build's size or flow_grpo's,
    model.resolution (a square) replacing the size."""
    height, width = builder_frame if model.builder is not None else default_frame
    if model.resolution is not None:
        height = width = int(model.resolution)
    return int(model.num_frames), height, width


class WanFamily(FlowFamily):
    """A flow family with Wan's parts, video latents and step (flow_grpo's Wan SDE step, ``policy_step``): loading
    (``load`` with this ``load_components``), the sampling and score steps, the schedule for another step count, the
    forward-process velocity (DiffusionNFT) and the reference policy (the adapter off) are FlowFamily's."""

    name = "wan"
    c: WanComponents

    def __init__(self, cfg, rt, components):
        from ddpo_tpu.models.wan import FLOW_GRPO_FRAME, TINY_FRAME

        self.cfg, self.rt, self.c = cfg, rt, components
        self.model = components.transformer
        self.dtype = self.model.dtype
        self.video = video_size(cfg.model, TINY_FRAME, FLOW_GRPO_FRAME)  # (frames, height, width) in pixels
        self.latent_shape = components.latent_shape(*self.video)      # (C, latent frames, h, w)
        self.tables = FlowTables.from_scheduler(components.scheduler, cfg.sample.num_steps, rt.device)
        self.num_steps = self.tables.num_steps

    PARTS = ("transformer", "vae", "text_encoder")  # moved to the device by FlowFamily.load

    @staticmethod
    def load_components(m, dtype):
        from ddpo_tpu.models.wan import ensure_tiny_wan, load_wan

        source, revision, local = checkpoint_source(m, ensure_tiny_wan)
        return load_wan(source, revision=revision, local_files_only=local, dtype=dtype)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Cond:
        from ddpo_tpu.models.wan import encode_prompts_wan

        (embeds,) = encode_distinct(prompts, lambda ps: (encode_prompts_wan(self.c, ps, self.rt.device),), self.rt)
        return (self.rt.shard_batch(embeds) if len(prompts) > 1 else embeds,)

    def prompt_keys(self, prompts: list[str], max_length: int) -> list[str]:
        """Per-prompt keys as train_wan2_1.py makes them: the UMT5 tokenizer's decoding of the prompt padded and cut
        to 512 tokens (its max_length, whatever the algorithm's key length for CLIP-tokenized families)."""
        from ddpo_tpu.models.wan import TEXT_TOKENS

        return decoded_prompts(self.c.tokenizer, prompts, TEXT_TOKENS)

    def velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                 detach_uncond: bool = False) -> Tensor:
        from ddpo_tpu.models.wan import wan_velocity

        timestep = (tables or self.tables).timestep_at(idx)
        return wan_velocity(self.call_denoiser(), x.to(self.dtype), timestep, cond[0],
                            uncond[0] if uncond is not None else None,
                            self.cfg.sample.guidance_scale if uncond is not None else 1.0, detach_uncond)

    def policy_step(self, tables: FlowTables, v: Tensor, idx: Tensor, x: Tensor, noise: Tensor | None = None,
                    prev_sample: Tensor | None = None):
        """flow_grpo's Wan SDE step (its deterministic branch is FlowFamily's Euler ODE step)."""
        return wan_sde_step(tables, v, idx, x, noise=noise, prev_sample=prev_sample)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> uint8 videos (B, F, H, W, 3) on the device."""
        from ddpo_tpu.models.wan import decode_wan

        video = decode_wan(self.c.vae, latents)  # (B, F, 3, H, W) in [0, 1]
        return (video * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2)

    def wrap_reward(self, reward):
        from ddpo_tpu.rewards.video import for_videos

        return for_videos(reward, self.cfg.reward)
