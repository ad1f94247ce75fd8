"""The DDPO sampler: DDIM with classifier-free guidance that records the trajectory (latents, log-probs, step
indices) needed to re-score it at train time.

Written for XLA: per-step inputs are fresh device data (noise and step indices uploaded from the host), constants are
gathered on the device (DDIMTables), nothing is read back inside the loop, and the graph is cut every
`sync_every` steps so the same few graphs serve every step, batch and epoch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ddpo_tpu.diffusion.ddim import DDIMTables
from ddpo_tpu.runtime.base import Runtime


@dataclass
class Trajectory:
    latents: Tensor        # (B, T + 1, C, h, w): x_T ... x_0 (with an SDE window: the window's W steps, W + 1)
    log_probs: Tensor      # (B, T): log pi(x_{t-1} | x_t) at sampling time
    step_indices: Tensor   # (B, T): position in the schedule of each step (0 = noisiest)
    final: Tensor | None = None  # (B, C, h, w): x_0, the sample (latents[:, -1] unless an SDE window ends earlier)

    @property
    def sample(self) -> Tensor:
        return self.final if self.final is not None else self.latents[:, -1]


def guided_noise_pred(unet, latents: Tensor, timesteps: Tensor, cond: Tensor, uncond: Tensor | None,
                      guidance_scale: float, detach_uncond: bool = False) -> Tensor:
    """UNet epsilon with classifier-free guidance (uncond=None: no guidance). detach_uncond: the same value, but the
    gradient flows through the conditional half only (guidance_scale x d cond; train.cfg_detach_uncond)."""
    if uncond is None:
        return unet(latents, timesteps, encoder_hidden_states=cond).sample
    out = unet(torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
               encoder_hidden_states=torch.cat([uncond, cond])).sample
    out_uncond, out_cond = out.chunk(2)
    if detach_uncond:
        out_uncond = out_uncond.detach()
    return out_uncond + guidance_scale * (out_cond - out_uncond)


def autocast_context(autocast):
    """The context a step function computes its model call in: `autocast()` (the runtime's bf16 autocast) or
    nothing when it is None (a test's plain float32 step)."""
    return autocast() if autocast is not None else contextlib.nullcontext()


def make_denoise_step(unet, tables: DDIMTables, *, eta: float, guidance_scale: float, autocast=None):
    """One guided DDIM step with its log-prob: (x_t, step index, noise, cond, uncond) -> (x_{t-1}, log pi).
    A plain function of tensors, so a backend can compile it once (Runtime.compile_step) and replay it every step."""

    def denoise_step(x: Tensor, idx: Tensor, z: Tensor, cond: Tensor, uncond: Tensor) -> tuple[Tensor, Tensor]:
        with autocast_context(autocast):
            eps = guided_noise_pred(unet, x, tables.timestep_at(idx), cond, uncond, guidance_scale)
            return tables.step(eps, idx, x, eta, noise=z)

    return denoise_step


@torch.no_grad()
def sample_trajectory(step, num_steps: int, cond, uncond, init_latents: Tensor, noise: Tensor, *, rt: Runtime,
                      sync_every: int, window: tuple[int, int] | None = None, ode_step=None) -> Trajectory:
    """Run a sampler of `num_steps` steps. `step` is a denoising step (x, step index, noise, cond, uncond) ->
    (x_prev, log_prob), e.g. make_denoise_step's, possibly compiled. `init_latents` (B,C,h,w) and `noise`
    (T,B,C,h,w) are host tensors drawn from the run's generator, so every backend samples the same trajectory for
    the same seed. `cond`/`uncond` (a tensor or a tuple of tensors) pass through to the step.

    `window` [first, end): only those steps are `step`'s (the SDE); the others are `ode_step`'s (the deterministic
    step, its log-prob ignored), and only the window is recorded: latents x_first ... x_end, the window's log-probs
    and step indices. The same two graphs serve every position of the window (the step index is data).

    A step with `multistep` set (a multistep solver: DiffusionNFT's DPM-Solver++, algorithms/nft_rollout.py) takes one
    more argument and returns one more value: its history (the previous x0 prediction), zeros before the first step."""
    first, end = window if window is not None else (0, num_steps)
    multistep = getattr(step, "multistep", False)
    dtype = (cond[0] if isinstance(cond, tuple) else cond).dtype
    x = rt.shard_batch(init_latents.to(rt.device, dtype=dtype))
    batch = x.shape[0]  # the rows this process samples (all of them unless distributed)
    latents, log_probs, indices = [], [], []
    history = torch.zeros_like(x) if multistep else None
    for i in range(num_steps):
        if i == first:
            latents.append(x)
        # an index per sample, uploaded as data: the traced graph is the same for every i
        idx = torch.full((batch,), i, dtype=torch.long).to(rt.device)
        z = rt.shard_batch(noise[i].to(rt.device, dtype=x.dtype))
        inside = first <= i < end
        if multistep:
            x, log_prob, history = step(x, idx, z, cond, uncond, history)
        else:
            x, log_prob = (step if inside else ode_step)(x, idx, z, cond, uncond)
        if inside:
            latents.append(x)
            log_probs.append(log_prob)
            indices.append(idx)
        if sync_every and (i + 1) % sync_every == 0 and i + 1 < num_steps:
            rt.sync()
    return Trajectory(torch.stack(latents, dim=1), torch.stack(log_probs, dim=1), torch.stack(indices, dim=1),
                      final=x if end < num_steps else None)


@torch.no_grad()
def decode_to_uint8(vae, latents: Tensor) -> Tensor:
    """VAE decode to uint8 (B, H, W, 3) on the device: a quarter of the bytes of float images cross to the host."""
    images = vae.decode(latents / vae.config.scaling_factor).sample
    images = (images.float() / 2 + 0.5).clamp(0, 1)
    return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
