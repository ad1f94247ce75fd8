"""The small interface between the training loop and a model family (SD 1.x with DDIM, SD 3 with flow matching).

Everything the loop does with a model goes through it: encode prompts, one guided denoising step with its
log-prob (sampling), the log-prob of a recorded step under the current weights (training), and decoding to images.
The step functions are plain functions of tensors so a runtime can compile each once (Runtime.compile_step).
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:  # annotations only: no import cycle, no cost at runtime
    from ddpo_tpu.config.schema import RunConfig
    from ddpo_tpu.diffusion.ddim import DDIMTables
    from ddpo_tpu.diffusion.flow import FlowTables
    from ddpo_tpu.runtime.base import Runtime

Cond = tuple[Tensor, ...]  # a batch's conditioning, batch first (SD 1.x: (text embeds,); SD 3: (embeds, pooled))


def checkpoint_source(model, ensure_tiny) -> tuple:
    """(path or hub id, revision, local_files_only) of a model config: its local build (made once by `ensure_tiny`
    in model.cache_dir), else model.pretrained as configured."""
    from pathlib import Path

    if model.builder is not None:
        return ensure_tiny(Path(model.cache_dir).expanduser()), None, True
    return model.pretrained, model.revision, model.local_files_only


def encode_distinct(prompts: list[str], encode, rt) -> tuple[Tensor, ...]:
    """``encode(prompts)`` (a tuple of batch-first tensors), each distinct prompt encoded once (GRPO's batches repeat
    every prompt group_size times) and its rows repeated, on an eager runtime. A runtime that compiles graphs
    encodes every row: how many prompts of a batch are distinct varies from batch to batch, and each new count
    would be a new text-encoder graph after epoch 0 (the encoder is a small part of an epoch's work)."""
    unique = prompts if rt.compiles_graphs else list(dict.fromkeys(prompts))
    out = encode(unique)
    if len(unique) < len(prompts):
        rows = torch.tensor([unique.index(p) for p in prompts]).to(rt.device)
        out = tuple(t.index_select(0, rows) for t in out)
    return out


class StepScore(NamedTuple):
    """A recorded step re-scored under the current weights."""

    log_prob: Tensor  # (B,)
    mean: Tensor      # (B, C, h, w): the step's Gaussian mean (a KL penalty between policies compares means)
    std: Tensor       # broadcastable against mean


class ModelFamily(abc.ABC):
    name: str
    cfg: RunConfig                   # the run's validated config (set at construction)
    rt: Runtime                      # the runtime the model lives on (set at construction)
    model: torch.nn.Module           # the denoiser; its trainable parameters are what a run trains
    latent_shape: tuple[int, ...]    # (C, h, w)
    num_steps: int                   # denoising steps per sample
    # what the step functions call: the model, or the runtime's data-parallel wrapper of it (DDP's forward arms its
    # gradient hooks); set by the trainer before the steps are made (Runtime.prepare_model)
    denoiser: torch.nn.Module | None = None
    # the sampler's device tables for the run's schedule, set at construction (each family narrows the type)
    tables: DDIMTables | FlowTables

    @classmethod
    @abc.abstractmethod
    def load(cls, cfg, rt) -> "ModelFamily":
        """The family's model from the run config, trainable (LoRA or full), on the runtime's device."""

    def call_denoiser(self) -> torch.nn.Module:
        return self.denoiser if self.denoiser is not None else self.model

    @abc.abstractmethod
    def prompt_keys(self, prompts: list[str], max_length: int) -> list[str]:
        """Per-prompt statistics keys (GRPO's groups, DDPO's tracker) as the reference makes them: its tokenizer's
        decoding of the prompt's ids, `max_length` tokens unless the family's reference uses its own length."""

    @abc.abstractmethod
    def encode(self, prompts: list[str]) -> Cond:
        """Conditioning of the prompts on the device (batch laid out by the runtime when longer than one)."""

    @abc.abstractmethod
    def schedule(self, num_steps: int):
        """The sampler's device tables for a schedule of `num_steps` steps (the run's own for sample.num_steps)."""

    @abc.abstractmethod
    def make_denoise_step(self, autocast, tables=None, deterministic: bool = False):
        """(x_t, step index (B,), noise, cond, uncond) -> (x_prev, log_prob): one guided sampling step on `tables`
        (default: the run's schedule). `deterministic`: the sampler's noise-free step (DDIM with eta 0, the flow
        ODE), as evaluation may use; then the noise is ignored and log_prob is 0."""

    @abc.abstractmethod
    def make_score_step(self, autocast):
        """(x_t, step index (B,), x_prev, cond, uncond or None) -> StepScore: a recorded step under the current
        weights (uncond None: no guidance)."""

    def make_velocity(self, autocast):
        """(x0, noise, step index (B,), cond) -> (velocity, x_t, sigma): the forward process x_t = (1 - sigma) x0 +
        sigma noise at the schedule's sigma and the unguided velocity there (float32; sigma broadcastable against
        x0). Flow families only (DiffusionNFT trains on it)."""
        raise NotImplementedError(f"model.family={self.name} has no flow-matching velocity")

    @abc.abstractmethod
    def decode(self, latents: Tensor) -> Tensor:
        """Final latents -> uint8 images (B, H, W, 3) on the device (a video family: videos (B, F, H, W, 3))."""

    def wrap_reward(self, reward):
        """The run's reward as it scores decode's output on the host: the reward itself for images; a video family
        wraps it to score every frame and reduce (rewards/video.py)."""
        return reward

    def trainable_state(self) -> dict[str, Tensor]:
        """The trained weights (LoRA adapter or the full denoiser), on the device."""
        from ddpo_tpu.models.lora import trainable_state_dict

        return trainable_state_dict(self.model, self.cfg.model, to_host=False)

    def load_trainable_state(self, state: dict[str, Tensor]) -> None:
        from ddpo_tpu.models.lora import load_trainable_state_dict

        load_trainable_state_dict(self.model, self.cfg.model, state)

    def reference(self):
        """A context in which the model is the reference policy (the adapter off): GRPO's KL term."""
        return contextlib.nullcontext()
