"""FLUX.2-klein's Flow-GRPO step and log-prob (ddpo_tpu.families.flux2) equal X-GenGroup/Flow-Factory's FLUX.2-klein
computation on the tiny build to float32 rounding, with and without CFG; its deterministic sampling and decoding equal
diffusers 0.42.1's own ``Flux2KleinPipeline`` on the same latents.

The reference side is written here from Flow-Factory's code at a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c, in its order
of operations, not from ours:
* ``src/flow_factory/models/flux/flux2_klein.py`` ``Flux2KleinAdapter._inference`` (:463-533: the pipeline's
  ``prepare_latents``, ``mu = compute_empirical_mu(tokens, N)``, ``set_scheduler_timesteps``, ``t_next`` the next
  timestep or 0, the noise level from the scheduler's SDE steps) and ``_forward`` (:767-829: the transformer on
  ``latents.to(float32)`` with ``t.expand(B) / 1000``, no guidance embedding, the conditional and (CFG, guidance > 1
  with negative embeddings) the unconditional pass one after the other, ``neg + g (cond - neg)``, then
  ``scheduler.step(noise_pred, t, latents, timestep_next=t_next, next_latents=...)``);
* ``src/flow_factory/scheduler/flow_match_euler_discrete.py`` ``set_scheduler_timesteps`` (:49-77: sigmas
  linspace(1, 1/N, N) with mu) and ``FlowMatchEulerDiscreteSDEScheduler.step`` (:243-371, "Flow-SDE": with
  ``timestep_next`` given, sigma = t / 1000 and sigma_prev = t_next / 1000; ``sigma_max = self.sigmas[1]``; the mean,
  the noise ``std_dev_t sqrt(-dt) eps``, the Gaussian log-density averaged over every non-batch dimension), and its
  default SDE steps (:126-137: every step but the last, where the noise level is 0).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ddpo_tpu.config.compose import compose_and_validate

FF_COMMIT = "a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c"
STEPS, NOISE_LEVEL = 4, 0.7  # Flow-Factory's klein-base noise_level


# --- the reference, from Flow-Factory's code -------------------------------------------------------------------------

def ff_set_scheduler_timesteps(scheduler, num_inference_steps, mu):
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

    sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    if getattr(scheduler.config, "use_flow_sigmas", False):
        sigmas = None
    timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, "cpu", sigmas=sigmas, mu=mu)
    return timesteps


def ff_flow_sde_step(scheduler, noise_pred, timestep, latents, timestep_next, noise_level, next_latents=None,
                     variance_noise=None):
    """FlowMatchEulerDiscreteSDEScheduler.step, Flow-SDE, ``timestep_next`` given; ``variance_noise`` is the
    ``randn_tensor`` draw. Returns (next_latents, log_prob, next_latents_mean, std_dev_t)."""
    sigma = timestep / 1000
    sigma_prev = timestep_next / 1000
    input_dtype = latents.dtype
    noise_pred, latents = noise_pred.float(), latents.float()
    if next_latents is not None:
        next_latents = next_latents.float()
    b = latents.shape[0]

    def bc(v):  # to_broadcast_tensor: (B, 1, 1)
        return torch.as_tensor(v, dtype=torch.float32).reshape(-1).expand(b).reshape(b, 1, 1)

    noise_level, sigma, sigma_prev = bc(noise_level), bc(sigma), bc(sigma_prev)
    dt = sigma_prev - sigma
    sigma_max = bc(scheduler.sigmas[1].item())
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1.0, sigma_max, sigma))) * noise_level
    mean = latents * (1 + std_dev_t**2 / (2 * sigma) * dt) + noise_pred * (1 + std_dev_t**2 * (1 - sigma)
                                                                           / (2 * sigma)) * dt
    if next_latents is None:
        next_latents = (mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise).to(input_dtype).float()
    std_variance = std_dev_t * torch.sqrt(-1 * dt)
    log_prob = (-((next_latents.detach() - mean) ** 2) / (2 * std_variance**2) - torch.log(std_variance)
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return next_latents, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t


def ff_forward(transformer, scheduler, t, t_next, latents, latent_ids, prompt_embeds, text_ids, negative_prompt_embeds,
               negative_text_ids, guidance_scale, noise_level, next_latents=None, variance_noise=None):
    """Flux2KleinAdapter._forward (text-to-image: no condition images)."""
    batch_size = latents.shape[0]
    do_cfg = guidance_scale > 1.0 and negative_prompt_embeds is not None
    latent_model_input = latents.to(torch.float32)
    noise_pred = transformer(hidden_states=latent_model_input, timestep=t.expand(batch_size) / 1000, guidance=None,
                             encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=latent_ids,
                             return_dict=False)[0]
    noise_pred = noise_pred[:, :latents.shape[1]]
    if do_cfg:
        neg = transformer(hidden_states=latent_model_input, timestep=t.expand(batch_size) / 1000, guidance=None,
                          encoder_hidden_states=negative_prompt_embeds, txt_ids=negative_text_ids,
                          img_ids=latent_ids, return_dict=False)[0]
        neg = neg[:, :latents.shape[1]]
        noise_pred = neg + guidance_scale * (noise_pred - neg)
    return ff_flow_sde_step(scheduler, noise_pred, t, latents, t_next, noise_level, next_latents, variance_noise)


# --- ours against it -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def family(model_cache):
    from ddpo_tpu.families import load_family
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate(["+experiment=flux2_grpo_smoke", f"model.cache_dir={model_cache}",
                              f"sample.num_steps={STEPS}", f"sample.noise_level={NOISE_LEVEL}",
                              f"sample.sde_window.size={STEPS - 1}"])
    torch.manual_seed(0)
    fam = load_family(v.cfg, make_runtime(v.cfg))
    with torch.no_grad():  # a trained-looking adapter: peft's init leaves lora_B at zero
        for name, p in fam.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return fam


def pipeline_of(fam):
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    c = fam.c
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(c.scheduler.config), vae=c.vae,
                              text_encoder=c.text_encoder, tokenizer=c.tokenizer, transformer=fam.model)


def guided(fam, scale):
    """The family with sample.guidance_scale = ``scale`` (the run's value, as the velocity reads it)."""
    cfg = fam.cfg
    fam.cfg = cfg.model_copy(update={"sample": cfg.sample.model_copy(update={"guidance_scale": float(scale)})})


@pytest.mark.parametrize("scale", [1.0, 4.0])  # the distilled klein examples' 1.0; the klein-base examples' CFG 4.0
def test_sampling_steps_and_log_probs_equal_flow_factorys_flux2_klein(family, scale):
    from ddpo_tpu.models.flux2 import compute_empirical_mu, pack, text_ids

    fam, prompts = family, ["a cat", "a dog riding a bike", "a horse"]
    guided(fam, scale)
    assert fam.latent_shape == (16, 32) and fam.num_steps == STEPS
    pipe = pipeline_of(fam)
    cond, uncond = fam.encode(prompts), fam.encode([""] * 3)
    # Flow-Factory's encode_prompt: the pipeline's Qwen3 states; negative prompt "" (flux2_klein.py:165-219)
    pe = pipe.encode_prompt(prompts, device="cpu")[0].detach()
    ne = pipe.encode_prompt([""] * 3, device="cpu")[0].detach()
    torch.testing.assert_close(cond[0], pe, rtol=0, atol=0)
    init4 = torch.randn(3, 32, 4, 4, generator=torch.Generator().manual_seed(1))  # patchified, as prepare_latents
    latents, latent_ids = pipe.prepare_latents(3, 8, 32, 32, pe.dtype, "cpu", None, init4.clone())
    assert torch.equal(latents, pack(init4)) and torch.equal(latent_ids[0], fam.img_ids)
    txt = pipe._prepare_text_ids(pe)
    assert torch.equal(txt[0], text_ids(512))
    timesteps = ff_set_scheduler_timesteps(pipe.scheduler, STEPS, compute_empirical_mu(latents.shape[1], STEPS))
    torch.testing.assert_close(fam.tables.timesteps[:STEPS], timesteps.float(), rtol=0, atol=0)
    noise = [torch.randn(latents.shape, generator=torch.Generator().manual_seed(10 + i)) for i in range(STEPS)]
    step, ode = fam.make_denoise_step(None), fam.make_denoise_step(None, deterministic=True)
    x_ref, x = latents.clone(), latents.clone()
    lps = set()
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            t_next = timesteps[i + 1] if i + 1 < len(timesteps) else torch.tensor(0)
            level = NOISE_LEVEL if i < STEPS - 1 else 0.0  # the default SDE steps: all but the last
            idx = torch.full((3,), i, dtype=torch.long)
            if level > 0:
                x_ref, ref_lp, _, _ = ff_forward(fam.model, pipe.scheduler, t, t_next, x_ref, latent_ids, pe, txt,
                                                 ne, txt, scale, level, variance_noise=noise[i])
                x, lp = step(x, idx, noise[i], cond, uncond)
                torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
                lps.add(round(float(lp[0]), 3))
            else:  # the ODE step (Flow-SDE at noise level 0: the mean)
                x_ref, _, _, _ = ff_forward(fam.model, pipe.scheduler, t, t_next, x_ref, latent_ids, pe, txt, ne,
                                            txt, scale, 0.0, variance_noise=torch.zeros_like(x_ref))
                x, _ = ode(x, idx, None, cond, uncond)
            torch.testing.assert_close(x, x_ref, rtol=1e-5, atol=1e-5)
    assert len(lps) == STEPS - 1  # a step's log-prob depends on its sigma


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_training_log_prob_and_mean_equal_flow_factorys_step_on_recorded_latents(family, scale):
    from ddpo_tpu.models.flux2 import compute_empirical_mu

    fam, prompts = family, ["a cat", "a dog riding a bike"]
    guided(fam, scale)
    pipe = pipeline_of(fam)
    cond, uncond = fam.encode(prompts), fam.encode([""] * 2)
    latents, latent_ids = pipe.prepare_latents(2, 8, 32, 32, torch.float32, "cpu", None,
                                               torch.randn(2, 32, 4, 4, generator=torch.Generator().manual_seed(2)))
    txt = pipe._prepare_text_ids(cond[0])
    timesteps = ff_set_scheduler_timesteps(pipe.scheduler, STEPS, compute_empirical_mu(latents.shape[1], STEPS))
    score = fam.make_score_step(None)
    x = latents
    for j in range(STEPS - 1):
        t, t_next = timesteps[j], timesteps[j + 1]
        with torch.no_grad():
            nxt, sampled_lp, _, _ = ff_forward(fam.model, pipe.scheduler, t, t_next, x, latent_ids, cond[0], txt,
                                               uncond[0], txt, scale, NOISE_LEVEL,
                                               variance_noise=torch.randn(x.shape, generator=torch.Generator()
                                                                          .manual_seed(j)))
        idx = torch.full((2,), j, dtype=torch.long)
        ours = score(x, idx, nxt, cond, uncond if scale > 1 else None)
        with torch.no_grad():
            _, ref_lp, ref_mean, ref_std = ff_forward(fam.model, pipe.scheduler, t, t_next, x, latent_ids, cond[0],
                                                      txt, uncond[0], txt, scale, NOISE_LEVEL, next_latents=nxt)
        torch.testing.assert_close(ours.log_prob.detach(), ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.mean.detach(), ref_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.std.reshape(-1), ref_std.reshape(-1), rtol=1e-5, atol=0)
        torch.testing.assert_close(ref_lp, sampled_lp)  # the recorded step scores as it was sampled (ratio 1)
        ours.log_prob.sum().backward()
        grads = [p.grad for n, p in fam.model.named_parameters() if "lora" in n]
        assert any(g is not None and g.abs().sum() > 0 for g in grads)
        fam.model.zero_grad(set_to_none=True)
        x = nxt


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_deterministic_sampling_and_decode_equal_flux2_klein_pipeline(family, scale):
    """Flux2KleinPipeline.__call__ (its own prompt encoding, CFG with "" above 1, scheduler.step, unpacking, the
    batch-norm denormalisation, unpatchify, the VAE and postprocess) on the same initial latents."""
    from ddpo_tpu.models.flux2 import decode_flux2, pack

    fam, prompts = family, ["a cat", "a dog riding a bike"]
    guided(fam, scale)
    init4 = torch.randn(2, 32, 4, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        images = pipeline_of(fam)(prompt=prompts, height=32, width=32, num_inference_steps=STEPS,
                                  guidance_scale=scale, latents=init4.clone(), output_type="pt").images
        cond, uncond = fam.encode(prompts), fam.encode([""] * 2)
        ode = fam.make_denoise_step(None, deterministic=True)
        x = pack(init4)
        for i in range(STEPS):
            x, _ = ode(x, torch.full((2,), i, dtype=torch.long), None, cond, uncond)
        ours = decode_flux2(fam.c.vae, x, fam.side, fam.side)
    assert images.shape == ours.shape == (2, 3, 32, 32)
    torch.testing.assert_close(ours, images, rtol=1e-5, atol=2e-6)
    assert torch.equal(fam.decode(x), (ours * 255).round().to(torch.uint8).permute(0, 2, 3, 1))
    if scale == 1.0:  # CFG changes the image: the unconditional pass ran
        guided(fam, 4.0)
        with torch.no_grad():
            y = pack(init4)
            for i in range(STEPS):
                y, _ = ode(y, torch.full((2,), i, dtype=torch.long), None, cond, uncond)
        assert (y - x).abs().max() > 1e-3
