"""Qwen-Image-Edit-2509 ("edit plus"): Qwen-Image (families/qwen_image.py) sampling an edit of each prompt's input
images. Everything but the conditioning is Qwen-Image's: the packed latents, the schedule (its shift from the generated
tokens only, as QwenImageEditPlusPipeline's ``image_seq_len = latents.shape[1]``), Flow-GRPO's SDE step, the decode.

The images come with the prompts: the run's prompt source is an edit dataset (prompts/datasets.py: each row names its
input images), and ``encode(prompts)`` looks each prompt's images up there and returns them in the conditioning it
hands the sampler, ``(embeds, mask, image latents)`` (models/qwen_image_edit.py: the pictures through Qwen2.5-VL with
the prompt, and through the VAE as the packed tokens appended to the generated ones). So the sampler, the trajectories
and the training step carry the images as any other conditioning tensor; nothing in diffusion/ knows of them.

Guidance: the pipeline's negative prompt is encoded with the same pictures, one negative per row; the loop's one
unconditional prompt (``encode([""])``) cannot carry them, so sample.guidance_scale must stay 1 (refused at compose
time, catalog/edit_checks.py::edit_family_problems). flow_grpo's edit runs use true CFG; that is left to do.
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

    def _encode_rows(self, prompts: list[str]) -> tuple[Tensor, Tensor, Tensor]:
        from ddpo_tpu.models.qwen_image_edit import encode_edit_images, encode_edit_prompt

        device = self.rt.device
        embeds, masks, latents = [], [], []
        for prompt, images in zip(prompts, self.pictures(prompts)):
            e, m = encode_edit_prompt(self.c, prompt, images, device, self.text_tokens)
            z, shapes = encode_edit_images(self.c, images, device, self.vae_area)
            if self.image_shapes is None:
                self.image_shapes = shapes
            elif shapes != self.image_shapes:
                raise ValueError(f"model.family=qwen_image_edit: the prompt {prompt[:60]!r}'s pictures are "
                                 f"{shapes} latent tokens, others {self.image_shapes}: a batch shares one shape "
                                 "(give every row input images of one size and count)")
            embeds.append(e)
            masks.append(m)
            latents.append(z[0].to(self.dtype))
        return torch.stack(embeds), torch.stack(masks), torch.stack(latents)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Cond:
        from ddpo_tpu.models.qwen_image import NEGATIVE_PROMPT, encode_prompts_qwen

        if all(not p for p in prompts):  # the loop's unconditional prompt: unused at guidance 1 (see the docstring)
            embeds, mask = encode_prompts_qwen(self.c, [NEGATIVE_PROMPT] * len(prompts), self.rt.device)
            return embeds, mask, torch.zeros(len(prompts), 0, self.latent_shape[1], device=self.rt.device,
                                             dtype=self.dtype)
        out = encode_distinct(prompts, self._encode_rows, self.rt)
        if len(prompts) > 1:
            out = tuple(self.rt.shard_batch(t) for t in out)
        return out

    def velocity(self, x: Tensor, idx: Tensor, cond: Cond, uncond: Cond | None, tables: FlowTables | None = None,
                 detach_uncond: bool = False) -> Tensor:
        from ddpo_tpu.models.qwen_image_edit import edit_velocity

        if uncond is not None and self.cfg.sample.guidance_scale != 1.0:
            raise NotImplementedError("model.family=qwen_image_edit samples without guidance (sample.guidance_scale=1)")
        side = self.latent_size // 2
        shapes = [[(1, side, side), *(self.image_shapes or [])]] * x.shape[0]
        return edit_velocity(self.call_denoiser(), x.to(self.dtype), cond[2], (tables or self.tables).timestep_at(idx),
                             cond[0], cond[1], shapes)
