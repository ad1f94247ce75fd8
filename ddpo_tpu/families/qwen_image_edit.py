"""Qwen-Image-Edit-2509 ("edit plus"): Qwen-Image (families/qwen_image.py) sampling an edit of each prompt's input
images. Everything but the conditioning is Qwen-Image's: the packed latents, the schedule (its shift from the generated
tokens only, as QwenImageEditPlusPipeline's ``image_seq_len = latents.shape[1]``), Flow-GRPO's SDE step, the decode.

The images come with the prompts: the run's prompt source is an edit dataset (prompts/datasets.py: each row names its
input images), and ``encode(prompts)`` looks each prompt's images up there and returns them in the conditioning it
hands the sampler, ``(embeds, mask, image latents)`` (models/qwen_image_edit.py: the pictures through Qwen2.5-VL with
the prompt, and through the VAE as the packed tokens appended to the generated ones). So the sampler, the trajectories
and the training step carry the images as any other conditioning tensor; nothing in diffusion/ knows of them.

Guidance (true CFG, sample.guidance_scale != 1): the negative prompt depends on the row. QwenImageEditPlusPipeline
encodes its negative prompt with the same pictures as the prompt (diffusers 0.42.1 pipeline_qwenimage_edit_plus.py,
``__call__`` step 3: ``encode_prompt(image=condition_images, prompt=negative_prompt)``), and flow_grpo's edit sampler
encodes it row by row with the row's pictures (yifan123/flow_grpo@9dcdc35b211205511f171a4f3566e40786575bc3
flow_grpo/diffusers_patch/qwenimage_edit_plus_pipeline_with_logprob.py, the per-row loop at lines ~101-127: the row's
``[ref, image]`` with ``negative_prompt[i]``, " " from scripts/train_qwenimage_edit_plus.py). The loop's one
unconditional prompt (``encode([""])``, expanded to the batch) cannot carry that, so when this family samples with
guidance, ``encode(prompts)`` returns each row's negative beside its conditioning, ``(embeds, mask, image latents,
negative embeds, negative mask)``; the loop's ``uncond`` is only the switch that turns guidance on (its content, a
(B, 1) zero, is not read). The row's negative then travels with the row through sampling, the recorded trajectories and
the training re-scoring as any conditioning tensor; nothing in
training/ or diffusion/ changes. The guided velocity is flow_grpo's: both passes as one batch (cond first), the
prediction cut to the generated tokens, ``neg + g (cond - neg)`` rescaled per token to the conditional one's norm
(models/qwen_image_edit.py::edit_velocity), in sampling (the pipeline's denoising loop) and in re-scoring (the edit
script's ``compute_log_prob``, with ``config.sample.guidance_scale``).

flow_grpo's sampler as written passes the positive ``prompt_embeds`` it has just computed to the negative prompt's
``encode_prompt`` call (and the previous row's to the next row's), and diffusers' ``encode_prompt`` encodes only when
``prompt_embeds is None``: its negative is then the positive (guidance a no-op) and every row reuses the first row's
states. We follow what the code sets out to do and what the pipeline does (each row's own prompt and negative, each
with the row's pictures), not that slip. At guidance 1 nothing of this is encoded or run: one conditional pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.families.base import Cond, checkpoint_source, encode_distinct
from ddpo_tpu.families.qwen_image import QwenImageFamily


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image with each prompt's input images in its conditioning."""

    name = "qwen_image_edit"

    def __init__(self, cfg, rt, components):
        from ddpo_tpu.models import qwen_image_edit as qe
        from ddpo_tpu.prompts import source_from_config

        super().__init__(cfg, rt, components)
        tiny = cfg.model.builder is not None
        self.vae_area = qe.TINY_VAE_IMAGE_SIZE if tiny else qe.FLOW_GRPO_VAE_IMAGE_SIZE
        self.text_tokens = qe.TINY_EDIT_TEXT_TOKENS if tiny else qe.EDIT_TEXT_TOKENS
        self.source = source_from_config(cfg.prompts)  # the rows naming each prompt's input images
        self.image_shapes: list | None = None  # the pictures' RoPE shapes, the same for every row of a run

    @staticmethod
    def load_components(m, dtype):
        from ddpo_tpu.models.qwen_image_edit import ensure_tiny_qwen_image_edit, load_qwen_image_edit

        source, revision, local = checkpoint_source(m, ensure_tiny_qwen_image_edit)
        return load_qwen_image_edit(source, revision=revision, local_files_only=local, dtype=dtype)

    def pictures(self, prompts: list[str]) -> list[list]:
        """Each prompt's input images (PIL, RGB) from its dataset row (``source_images``: uint8 (H, W, 3) arrays)."""
        from PIL import Image

        out = []
        for prompt, row in zip(prompts, self.source.metadata(prompts)):
            images = row.get("source_images")
            if not images:
                raise ValueError(f"model.family=qwen_image_edit: the prompt {prompt[:60]!r} has no input images in "
                                 "the prompt dataset (prompts=dataset on an edit dataset, prompts/datasets.py)")
            out.append([Image.fromarray(a) for a in images])
        return out

    def guided(self) -> bool:
        """Whether this family's current config samples with guidance (evaluation swaps in a config of its own,
        training/evaluation.py::sampler_config, so this is read at each call)."""
        return self.cfg.sample.guidance_scale != 1.0

    def _encode_rows(self, prompts: list[str], negative: bool) -> tuple[Tensor, ...]:
        """The rows' ``(embeds, mask, image latents[, negative embeds, negative mask])``: the prompts with their
        pictures through the VL encoder as one batch (then the negatives, the same batch with " "), each row's
        pictures through the VAE. On a runtime that compiles graphs the encoder's input is padded to the family's
        fixed text length, so every batch of a run has the same shapes (models/qwen_image_edit.py::
        encode_edit_prompts)."""
        from ddpo_tpu.models.qwen_image import NEGATIVE_PROMPT
        from ddpo_tpu.models.qwen_image_edit import encode_edit_images, encode_edit_prompts

        device, fixed = self.rt.device, self.rt.compiles_graphs
        pictures = self.pictures(prompts)
        # flow_grpo's order: the row's prompt, then its negative, both with the row's pictures, then the latents
        parts = list(encode_edit_prompts(self.c, prompts, pictures, device, self.text_tokens, fixed_length=fixed))
        if negative:
            parts += encode_edit_prompts(self.c, [NEGATIVE_PROMPT] * len(prompts), pictures, device, self.text_tokens,
                                         fixed_length=fixed)
        latents = []
        for prompt, images in zip(prompts, pictures):
            z, shapes = encode_edit_images(self.c, images, device, self.vae_area)
            if self.image_shapes is None:
                self.image_shapes = shapes
            elif shapes != self.image_shapes:
                raise ValueError(f"model.family=qwen_image_edit: the prompt {prompt[:60]!r}'s pictures are "
                                 f"{shapes} latent tokens, others {self.image_shapes}: a batch shares one shape "
                                 "(give every row input images of one size and count)")
            latents.append(z[0].to(self.dtype))
        embeds, mask, *neg = parts
        return (embeds, mask, torch.stack(latents), *neg)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Cond:
        if all(not p for p in prompts):  # the loop's unconditional prompt: only a switch (see the docstring)
            return (torch.zeros(len(prompts), 1, device=self.rt.device, dtype=self.dtype),)
        negative = self.guided()
        out = encode_distinct(prompts, lambda ps: self._encode_rows(ps, negative), self.rt)
        if len(prompts) > 1:
            out = tuple(self.rt.shard_batch(t) for t in out)
        return out

    def velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                 detach_uncond: bool = False) -> Tensor:
        from ddpo_tpu.models.qwen_image_edit import edit_velocity

        guided = uncond is not None and self.guided()
        if guided and len(cond) < 5:
            raise ValueError("model.family=qwen_image_edit: guided sampling needs each row's negative prompt in its "
                             "conditioning; these prompts were encoded at sample.guidance_scale=1")
        side = self.latent_size // 2
        shapes = [[(1, side, side), *(self.image_shapes or [])]] * x.shape[0]
        neg = (cond[3], cond[4]) if guided else (None, None)
        return edit_velocity(self.call_denoiser(), x.to(self.dtype), cond[2], (tables or self.tables).timestep_at(idx),
                             cond[0], cond[1], shapes, neg[0], neg[1],
                             self.cfg.sample.guidance_scale if guided else 1.0, detach_uncond)
