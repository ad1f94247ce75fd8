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

Wan 2.2 is the same family (models/wan.py: its builds and loading):

* TI2V-5B's text-to-video path: 48 latent channels, 16x spatial compression (the VAE's own 2x2 patching on top of
  its 8x), so a frame is H / 32 x W / 32 video tokens; with ``expand_timesteps`` the transformer gets the step's
  timestep once per video token, as WanPipeline.__call__ builds it (diffusers 0.42.1 pipeline_wan.py:607-611).
* T2V-A14B's two experts: ``transformer`` for the steps whose timestep t >= boundary_ratio x num_train_timesteps,
  ``transformer_2`` below (pipeline_wan.py:585-604), held as one module (models/wan.py ``WanExperts``) so the loop
  trains, checkpoints, switches adapters off for the reference and moves them as one. ``model.train_experts`` names
  the experts that get LoRA (or are fine-tuned): ``[high, low]`` (null: both) or one of them; the other stays frozen.
  Guidance: sample.guidance_scale for both experts (WanPipeline's guidance_scale_2 defaults to it).

How the expert is chosen without data-dependent graphs: the schedule is fixed per run (the tables' timesteps), so
which expert a step index calls is a host-side table (``_high_steps``: one bool per step index, computed once per
schedule). ``velocity`` reads the batch's step indices on the host (``_expert_side``: a transfer of a small int
tensor, outside any graph) and calls the one expert all its rows need: eager, and torch_xla's lazy tracing
(xla.step_compiler=lazy), which then compiles one graph per expert. A batch mixing both sides (training's fused
timesteps straddling the boundary) runs each expert on its own rows when eager, and both experts on every row with a
per-row select (torch.where on ``timestep >= boundary``, a device op) where graphs are compiled: one more fixed graph,
so the set is at most three whatever the batches hold. Under dynamo (xla.step_compiler=dynamo, the default) two
experts are refused at load: a host read breaks the captured graph and torch_xla 2.9's dynamo bridge failed on the
resumed graphs ("Failed to get computation by hash"), and a step holding both experts failed in its output
deduplication too ("Executable expected parameter 0 of size 16384 but got buffer with incompatible size 24"), both on
XLA CPU. What a dynamo path needs (not done: it is the loop's, training/loop.py and training/evaluation.py): the loop
compiles one step function (``rt.compile_step(make_denoise_step(...))`` / ``make_score_step``) whose step index is a
tensor; it would instead ask the family for one step function per expert (each calling ``.high`` or ``.low`` with no
host read inside, so each captures whole), pick one by the step index it holds as a Python int on the host (sampling's
``for j in range(T)``; training's micro-batch timestep column, the same for every row when the trajectories' step
order is not permuted per row), and keep the mixed-batch select out of dynamo (or fuse only same-side timesteps), the
step that failed in torch_xla 2.9's output deduplication.

Several processes (torchrun: DDP or FSDP2, runtime/distributed.py ``prepare_model``): every velocity is ONE forward of
the denoiser the runtime wrapped, ``WanExperts.forward(run)`` running this family's expert calls (``run(experts)``),
so the wrapper's forward hooks see each expert the step calls (also both experts of a mixed batch and the two guided
passes, all under one forward). DDP: a step whose rows call one expert leaves the other's LoRA out of the graph, so
WanExperts asks for ``find_unused_parameters`` (every other model keeps DDP's default). Chosen over (a) both experts'
LoRA always in the graph (a ``0 x`` term: the idle expert then gets zero gradients, which move AdamW's moments and
decay where a run today, whose gradient is None, skips the weight: a change to one-process training too) and (b) one
DDP per expert (an accumulation window whose last, synchronised micro-step calls one expert would never reduce the
other's accumulated gradient). DDP with ``find_unused_parameters`` instead marks the idle expert's weights ready (a
weight used anywhere in the accumulation window is reduced with its accumulated gradient; one unused on every rank
keeps its None) and costs, per forward under grad, a host walk of the autograd graph from the output, and per update
one more all-reduce of a used flag per trained tensor; the LoRA gradient buckets of both experts are all-reduced every
update (idle ones as zeros), the same bytes as a step calling both; on the tiny build no time difference above noise
(docs/distributed.md). FSDP2: each expert is its own ``fully_shard`` unit under the pair's
(``WanExperts.fsdp_units``), so a step gathers the weights of the expert it calls, not both; the idle expert's shards
see no reduce-scatter.
"""

from __future__ import annotations


from typing import Any, TYPE_CHECKING

import numpy as np
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
        from ddpo_tpu.models.loading import ModelLoadError
        from ddpo_tpu.models.wan import FLOW_GRPO_FRAME, TINY_FRAME, WanExperts

        self.cfg, self.rt, self.c = cfg, rt, components
        # A14B: both experts as one module (what the loop trains); else the one transformer
        self.model = components.transformer if components.transformer_2 is None else WanExperts(
            components.transformer, components.transformer_2)
        self.dtype = self.model.dtype
        self._high: dict[int, np.ndarray] = {}  # id(tables) -> the host table of steps that call the high expert
        self.video = video_size(cfg.model, TINY_FRAME, FLOW_GRPO_FRAME)  # (frames, height, width) in pixels
        self.latent_shape = components.latent_shape(*self.video)      # (C, latent frames, h, w)
        # WanPipeline.check_inputs: frames in multiples of the VAE's factor x the patch (32 for TI2V-5B's VAE)
        multiple = components.scale_factors[1] * components.transformer.config.patch_size[1]
        if any(side % multiple for side in self.video[1:]):
            raise ModelLoadError(f"model.resolution={cfg.model.resolution}: this checkpoint's frames are multiples of "
                                 f"{multiple} pixels (its VAE's {components.scale_factors[1]}x and 2x2 patches), "
                                 f"not {self.video[1]}x{self.video[2]}. Fix: model.resolution="
                                 f"{max(multiple, round(self.video[1] / multiple) * multiple)}")
        self.tables = FlowTables.from_scheduler(components.scheduler, cfg.sample.num_steps, rt.device)
        self.num_steps = self.tables.num_steps
        self._high_steps(self.tables)  # the run's own, read once at load (not inside an epoch's counted transfers)

    PARTS = ("transformer", "transformer_2", "vae", "text_encoder")  # moved to the device by load

    @classmethod
    def load(cls, cfg, rt) -> "WanFamily":
        """FlowFamily.load with Wan 2.2 A14B's experts: LoRA (or full training) on the experts model.train_experts
        names (null: every expert the checkpoint has), the others frozen."""
        from ddpo_tpu.models.lora import make_trainable
        from ddpo_tpu.models.loading import ModelLoadError

        m = cfg.model
        comps = cls.load_components(m, torch.bfloat16 if m.dtype == "bfloat16" else torch.float32)
        experts = {"high": comps.transformer, "low": comps.transformer_2}
        names = list(m.train_experts) if m.train_experts is not None else [k for k, v in experts.items() if v]
        if comps.transformer_2 is None and names != ["high"]:
            raise ModelLoadError(f"model.train_experts={names}: this checkpoint has one transformer (no "
                                 "transformer_2), so only 'high' names an expert. Fix: model.train_experts=null")
        if comps.transformer_2 is not None and getattr(rt, "step_compiler", None) == "dynamo":
            raise ModelLoadError("model.family=wan with two experts (Wan 2.2 A14B) on XLA needs "
                                 "xla.step_compiler=lazy: the expert is chosen on the host per step, which a "
                                 "dynamo-captured step cannot do (families/wan.py). Fix: xla.step_compiler=lazy")
        for name in names:
            make_trainable(experts[name], m)  # adapter weights drawn from torch's global generator (seeded)
        for name in cls.PARTS:
            part = getattr(comps, name, None)
            if part is not None:
                setattr(comps, name, part.to(rt.device))
        fam = cls(cfg, rt, comps)
        fam.trained_experts = tuple(names)
        return fam

    trained_experts: tuple[str, ...] = ("high",)

    @staticmethod
    def load_components(m, dtype):
        from ddpo_tpu.models.wan import ensure_tiny_wan_build, load_wan

        source, revision, local = checkpoint_source(m, lambda cache: ensure_tiny_wan_build(m.builder, cache))
        return load_wan(source, revision=revision, local_files_only=local, dtype=dtype)

    def _trained_modules(self) -> dict[str, torch.nn.Module]:
        """The experts that train, by name (one transformer: {"": it}, the state's keys unprefixed as before)."""
        if self.c.transformer_2 is None:
            return {"": self.model}
        experts: Any = self.model  # WanExperts (models/wan.py) when there is a transformer_2
        return {f"{name}.": experts.expert(name) for name in self.trained_experts}

    def trainable_state(self) -> dict[str, Tensor]:
        """The trained weights; A14B's prefixed by expert ("high." / "low."), so a checkpoint keeps both adapters."""
        from ddpo_tpu.models.lora import trainable_state_dict

        return {prefix + k: v for prefix, module in self._trained_modules().items()
                for k, v in trainable_state_dict(module, self.cfg.model, to_host=False).items()}

    def load_trainable_state(self, state: dict[str, Tensor]) -> None:
        from ddpo_tpu.models.lora import load_trainable_state_dict

        modules = self._trained_modules()
        unknown = [k for k in state if not any(k.startswith(p) for p in modules)]
        if unknown:
            raise RuntimeError(f"checkpoint has weights of experts this run does not train: {unknown[:3]}")
        for prefix, module in modules.items():
            load_trainable_state_dict(module, self.cfg.model,
                                      {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def _high_steps(self, tables: FlowTables) -> np.ndarray | None:
        """One bool per step index of ``tables``: True where WanPipeline calls ``transformer`` (t >= boundary)."""
        boundary = self.c.boundary_timestep
        if boundary is None:
            return None
        key = id(tables)
        if key not in self._high:
            self._high[key] = tables.timesteps.detach().float().cpu().numpy() >= boundary
        return self._high[key]

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

        tables = tables or self.tables
        high_steps = self._high_steps(tables)
        # the host-side schedule (module docstring): which expert(s) these rows call, read outside any graph
        side = None if high_steps is None else _expert_side(idx, high_steps)
        timestep = tables.timestep_at(idx)
        if self.c.expand_timesteps:  # a timestep per video token (WanPipeline: mask[0][0][:, ::2, ::2] * t)
            transformer: Any = self.c.transformer
            p = transformer.config.patch_size
            tokens = x.shape[2] // p[0] * (x.shape[3] // p[1]) * (x.shape[4] // p[2])
            timestep = timestep.float()[:, None].expand(x.shape[0], tokens)
        call = lambda model, rows=None: wan_velocity(  # noqa: E731
            model, x.to(self.dtype) if rows is None else x.to(self.dtype).index_select(0, rows),
            timestep if rows is None else timestep.index_select(0, rows),
            cond[0] if rows is None else cond[0].index_select(0, rows),
            None if uncond is None else uncond[0] if rows is None else uncond[0].index_select(0, rows),
            self.cfg.sample.guidance_scale if uncond is not None else 1.0, detach_uncond)
        if side is None:
            return call(self.call_denoiser())
        assert high_steps is not None and self.c.boundary_timestep is not None  # side is not None: two experts
        boundary, table = self.c.boundary_timestep, high_steps  # bound here: the closure sees them narrowed

        def on_experts(experts) -> Tensor:
            if side != "mixed":
                return call(experts.high if side == "high" else experts.low)
            if self.rt.compiles_graphs:  # one fixed graph for a mixed batch: both experts on every row, kept per row
                keep = (tables.timestep_at(idx) >= boundary).view(-1, *([1] * (x.dim() - 1)))
                return torch.where(keep, call(experts.high), call(experts.low))
            high = table[idx.detach().cpu().numpy()]  # eager: each expert on its own rows
            rows_high = torch.as_tensor(np.flatnonzero(high), device=x.device)
            rows_low = torch.as_tensor(np.flatnonzero(~high), device=x.device)
            v_high, v_low = call(experts.high, rows_high), call(experts.low, rows_low)
            out = v_high.new_empty((x.shape[0], *v_high.shape[1:]))
            return out.index_copy(0, rows_high, v_high).index_copy(0, rows_low, v_low)

        # one forward of the denoiser (WanExperts.forward runs on_experts): through DDP's / FSDP2's wrapper when the
        # runtime wrapped it, so the wrapper's forward hooks see every expert call of this velocity
        return self.call_denoiser()(on_experts)

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


@torch.compiler.disable
def _expert_side(idx: Tensor, high_steps: np.ndarray) -> str:
    """"high", "low" or "mixed": which expert(s) the rows at step indices ``idx`` call, read on the host from the
    fixed schedule's table. Outside any compiled graph (dynamo breaks the graph here and resumes with a str it guards
    on: one graph per expert), and returning no tensor, so nothing it does joins a traced graph."""
    high = high_steps[idx.detach().cpu().numpy()]
    return "high" if high.all() else "low" if not high.any() else "mixed"
