"""Z-Image's sampling step, log-prob, guidance and schedule (ddpo_tpu.families.z_image, models/z_image.py) equal
X-GenGroup/Flow-Factory's Z-Image code on the tiny build to float32 rounding, and the deterministic sampler equals
diffusers' own ZImagePipeline (0.42.1) from the same initial latents.

The Flow-Factory side is written here from its code at a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c, in its order of
operations, not from ours:
* ``src/flow_factory/models/z_image/z_image.py::ZImageAdapter.forward`` (lines 390-492): the timestep
  ``t.expand(B).to(latents.dtype)``, the transformer's time ``(1000 - timestep) / 1000`` (401-402); with guidance
  (guidance_scale > 0 and negative states given), latents repeated twice, the caption lists concatenated cond + neg
  (430-438); each latent ``unsqueeze(2)`` and unbound into a list (440-441); per item ``pos + g (pos - neg)`` in float
  (452-472, no cfg_normalization); ``squeeze(2)`` and the negation (476-477); the scheduler's step with
  ``timestep_next`` (480-490);
* ``src/flow_factory/scheduler/flow_match_euler_discrete.py::FlowMatchEulerDiscreteSDEScheduler.step`` (243-431),
  its "Flow-SDE" branch: ``sigma = timestep / 1000``, ``sigma_prev = timestep_next / 1000`` (the inference loop
  passes t_next, 0 after the last step: z_image.py:278), ``dt = sigma_prev - sigma``, ``sigma_max = sigmas[1]``,
  std_dev_t, the mean, the sample ``mean + std_dev_t sqrt(-dt) noise``, and the log-prob averaged over all but the
  batch dimension (342-371). One adaptation: the step's ``randn_tensor(..., generator)`` noise is given here.
* the schedule: ``set_scheduler_timesteps`` (lines 49-80): sigmas ``np.linspace(1, 1/N, N)`` and mu from the image
  token count into ``retrieve_timesteps``; ZImagePipeline's own (pipeline_z_image.py:470-489) is the same.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

STEPS, NOISE_LEVEL = 4, 0.7  # Flow-Factory's Z-Image examples: noise_level 0.7
G = 4.0  # Z-Image base's guidance in Flow-Factory's example (guidance_scale 4.00) = sample.guidance_scale 5 here


# --- the reference, from Flow-Factory's code -------------------------------------------------------------------------

def ref_flow_sde_step(sigmas, noise_pred, timestep, latents, timestep_next, noise_level, next_latents=None,
                      noise=None):
    """FlowMatchEulerDiscreteSDEScheduler.step, Flow-SDE, ``timestep_next`` given (lines 300-371)."""
    sigma = timestep / 1000
    sigma_prev = timestep_next / 1000
    noise_pred, latents = noise_pred.float(), latents.float()
    if next_latents is not None:
        next_latents = next_latents.float()
    shape = (-1,) + (1,) * (latents.ndim - 1)  # to_broadcast_tensor
    noise_level = torch.as_tensor(noise_level, dtype=torch.float32).reshape(-1).expand(latents.shape[0]).reshape(shape)
    sigma = torch.as_tensor(sigma).reshape(-1).expand(latents.shape[0]).reshape(shape)
    sigma_prev = torch.as_tensor(sigma_prev).reshape(-1).expand(latents.shape[0]).reshape(shape)
    dt = sigma_prev - sigma
    sigma_max = torch.as_tensor(sigmas[1].item()).reshape(-1).expand(latents.shape[0]).reshape(shape)
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1.0, sigma_max, sigma))) * noise_level
    next_latents_mean = (latents * (1 + std_dev_t ** 2 / (2 * sigma) * dt)
                         + noise_pred * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt)
    if next_latents is None:
        next_latents = next_latents_mean + std_dev_t * torch.sqrt(-1 * dt) * noise
    std_variance = std_dev_t * torch.sqrt(-1 * dt)
    log_prob = (-((next_latents.detach() - next_latents_mean) ** 2) / (2 * std_variance ** 2)
                - torch.log(std_variance) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return next_latents, log_prob, next_latents_mean, std_dev_t


def ref_forward(transformer, sigmas, t, t_next, latents, prompt_embeds, negative_prompt_embeds, guidance_scale,
                noise_level, next_latents=None, noise=None):
    """ZImageAdapter.forward (lines 390-492), cfg_normalization off, cfg_truncation 1.0."""
    batch_size = latents.shape[0]
    timestep = t.expand(batch_size).to(latents.dtype)
    t_reversed = (1000 - timestep) / 1000
    apply_cfg = negative_prompt_embeds is not None and guidance_scale > 0.0  # t_norm <= 1 = cfg_truncation
    if apply_cfg:
        latent_model_input = latents.to(transformer.dtype).repeat(2, 1, 1, 1)
        prompt_embeds_model_input = prompt_embeds + negative_prompt_embeds
        timestep_model_input = t_reversed.repeat(2)
    else:
        latent_model_input = latents.to(transformer.dtype)
        prompt_embeds_model_input = prompt_embeds
        timestep_model_input = t_reversed
    latent_model_input_list = list(latent_model_input.unsqueeze(2).unbind(dim=0))
    model_out_list = transformer(latent_model_input_list, timestep_model_input, prompt_embeds_model_input,
                                 return_dict=False)[0]
    if apply_cfg:
        pos_out, neg_out = model_out_list[:batch_size], model_out_list[batch_size:]
        noise_pred = torch.stack([pos_out[j].float() + guidance_scale * (pos_out[j].float() - neg_out[j].float())
                                  for j in range(batch_size)], dim=0)
    else:
        noise_pred = torch.stack([out.float() for out in model_out_list], dim=0)
    noise_pred = -noise_pred.squeeze(2)
    return ref_flow_sde_step(sigmas, noise_pred, t, latents, t_next, noise_level, next_latents, noise)


# --- ours against it -------------------------------------------------------------------------------------------------

def _family(model_cache, guidance: float):
    from tests.helpers import family_with_trained_adapter

    return family_with_trained_adapter(["+experiment=z_image_grpo_smoke", f"model.cache_dir={model_cache}",
                                        f"sample.num_steps={STEPS}", f"sample.guidance_scale={guidance}",
                                        f"sample.noise_level={NOISE_LEVEL}", f"train.cfg={guidance > 1}"])


@pytest.fixture(scope="module")
def turbo(model_cache):
    return _family(model_cache, 1.0)


@pytest.fixture(scope="module")
def base(model_cache):
    return _family(model_cache, G + 1)


def pipeline_of(fam):
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    c = fam.c
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(c.scheduler.config), vae=c.vae,
                          text_encoder=c.text_encoder, tokenizer=c.tokenizer, transformer=fam.model)


def ref_timesteps(fam):
    """The scheduler's timesteps and sigmas as Flow-Factory's set_scheduler_timesteps sets them (16 image tokens)."""
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, retrieve_timesteps

    sched = pipeline_of(fam).scheduler
    c = sched.config
    mu = calculate_shift(16, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(sched, STEPS, "cpu", sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
    return timesteps, sched.sigmas


def test_the_schedule_is_the_pipelines_shift_3_schedule(turbo):
    """Our tables hold retrieve_timesteps' sigmas and timesteps; written out: the static shift 3 (the tiny build's
    scheduler config, Z-Image-Turbo's) on linspace(1, 1/N, N), then a final 0."""
    timesteps, sigmas = ref_timesteps(turbo)
    assert torch.equal(turbo.tables.sigmas, sigmas.float()) and torch.equal(turbo.tables.timesteps, timesteps.float())
    s = np.linspace(1.0, 1 / STEPS, STEPS)
    np.testing.assert_allclose(turbo.tables.sigmas.numpy(), np.append(3 * s / (1 + 2 * s), 0.0), rtol=1e-6)


@pytest.mark.parametrize("which", ["turbo", "base"])
def test_sampling_step_and_log_prob_equal_flow_factorys_z_image_forward(which, request):
    """Every step of a trajectory (the policy step with given noise, then the re-scored step at the recorded next
    latents) against ZImageAdapter.forward: next latents, mean, std and log-prob; Turbo without guidance, base with
    Z-Image's guidance 4 (sample.guidance_scale 5)."""
    fam = request.getfixturevalue(which)
    from ddpo_tpu.models.z_image import caption_list

    prompts = ["a cat", "a dog riding a bike", "a horse"]
    cond, uncond = fam.encode(prompts), fam.encode([""] * 3)
    guided = which == "base"
    pe, npe = caption_list(*cond), (caption_list(*uncond) if guided else None)
    timesteps, sigmas = ref_timesteps(fam)
    x = torch.randn(3, *fam.latent_shape, generator=torch.Generator().manual_seed(1))
    step, score = fam.make_denoise_step(None), fam.make_score_step(None)
    gen = torch.Generator().manual_seed(7)
    lps = []
    for i in range(STEPS):
        noise = torch.randn(x.shape, generator=gen)
        t_next = timesteps[i + 1] if i + 1 < STEPS else torch.tensor(0.0)
        with torch.no_grad():
            ref_next, ref_lp, ref_mean, ref_std = ref_forward(fam.model, sigmas, timesteps[i], t_next, x, pe, npe,
                                                              G if guided else 0.0, NOISE_LEVEL, noise=noise)
            idx = torch.full((3,), i)
            ours_next, ours_lp = step(x, idx, noise, cond, uncond if guided else None)
            scored = score(x, idx, ours_next, cond, uncond if guided else None)
            _, ref_lp2, _, _ = ref_forward(fam.model, sigmas, timesteps[i], t_next, x, pe, npe, G if guided else 0.0,
                                           NOISE_LEVEL, next_latents=ours_next)
        torch.testing.assert_close(ours_next, ref_next, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(ours_lp, ref_lp, rtol=2e-6, atol=2e-5)
        torch.testing.assert_close(scored.mean, ref_mean, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(scored.std.reshape(-1), ref_std.reshape(-1), rtol=2e-6, atol=0)
        torch.testing.assert_close(scored.log_prob, ref_lp2, rtol=2e-6, atol=2e-5)
        lps.append(float(ours_lp[0]))
        x = ours_next
    assert len({round(v, 3) for v in lps}) == STEPS  # each step its own sigma (the test sees the schedule)


def test_guidance_changes_the_velocity(base):
    """The guided and unguided velocities differ (the negative prompt reaches the transformer)."""
    cond, uncond = base.encode(["a cat"]), base.encode([""])
    x, idx = torch.randn(1, *base.latent_shape), torch.tensor([1])
    with torch.no_grad():
        assert (base.velocity(x, idx, cond, uncond) - base.velocity(x, idx, cond, None)).abs().max() > 1e-3


@pytest.mark.parametrize("which", ["turbo", "base"])
def test_the_ode_sampler_and_decode_equal_zimagepipelines_output(which, request):
    """Our deterministic sampler (the SDE at noise level 0) from the same initial latents against ZImagePipeline's
    own __call__ (guidance_scale 0 for Turbo, 4 for base; negative prompt ""): final latents and images."""
    fam = request.getfixturevalue(which)
    from ddpo_tpu.models.z_image import decode_z_image

    prompts = ["a cat", "a dog riding a bike"]
    guided = which == "base"
    init = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(3))
    pipe = pipeline_of(fam)
    with torch.no_grad():
        # list(prompts): ZImagePipeline._encode_prompt writes the templated prompts into the list it is given
        kw = dict(height=32, width=32, num_inference_steps=STEPS, guidance_scale=G if guided else 0)
        ref_latents = pipe(list(prompts), latents=init.clone(), output_type="latent", **kw).images
        ref_images = pipe(list(prompts), latents=init.clone(), output_type="pt", **kw).images
        cond, uncond = fam.encode(prompts), (fam.encode([""] * 2) if guided else None)
        ode = fam.make_denoise_step(None, deterministic=True)
        x = init
        for i in range(STEPS):
            x, _ = ode(x, torch.full((2,), i), None, cond, uncond)
        images = decode_z_image(fam.c.vae, x)
    torch.testing.assert_close(x, ref_latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(images, ref_images, rtol=1e-5, atol=1e-5)
    assert (x - init).abs().mean() > 0.1  # the sampler moved the latents


# --- the fixed-shape forward (compiling runtimes) against the transformer's own forward -------------------------------

def _tiny_transformer(seed=3):
    """The tiny build's transformer, every parameter nonzero (its pad tokens and final layer start at zero)."""
    from ddpo_tpu.models.z_image import _build_transformer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build_transformer().eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.abs().sum() == 0:
                    p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("side", [8, 6])  # 16 image tokens, and 9 (padded with x_pad_token to 32)
def test_the_fixed_shape_forward_equals_diffusers_forward_on_captions_of_different_buckets(side):
    """z_forward_fixed on captions of 5, 40 and 70 tokens (buckets 32, 64 and 96) held in one (3, 100, D) batch
    equals ZImageTransformer2DModel.forward on the list of those captions (diffusers 0.42.1, basic mode: its own
    per-row caption padding with cap_pad_token, RoPE offsets and batch mask), row by row to float32 rounding. The
    batch's shape is the same for any lengths: a compiling runtime traces one graph."""
    from ddpo_tpu.models.z_image import z_forward_fixed

    model = _tiny_transformer()
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 40, 70])
    states = torch.randn(3, 100, 32, generator=g)
    states = states * (torch.arange(100)[None, :] < lengths[:, None])[..., None]  # zero past each caption
    latents = torch.randn(3, 16, side, side, generator=g)
    t = torch.tensor([0.1, 0.5, 0.9])
    with torch.no_grad():
        ref = model([x.unsqueeze(1) for x in latents], t, [s[:n] for s, n in zip(states, lengths)],
                    return_dict=False)[0]
        ref = torch.stack([r.squeeze(1) for r in ref])
        ours = z_forward_fixed(model, latents, t, states, lengths)
        # each row alone: a row's output does not depend on the others (the observation the fixed shapes rest on)
        alone = torch.cat([z_forward_fixed(model, latents[i:i + 1], t[i:i + 1], states[i:i + 1], lengths[i:i + 1])
                           for i in range(3)])
    assert ours.shape == ref.shape == (3, 16, side, side)
    assert ref.abs().mean() > 0.1  # a velocity that depends on its inputs
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)
    # the caption bucket matters (a wrong pad or RoPE offset would show): 40 tokens read as 33 is another output
    with torch.no_grad():
        other = z_forward_fixed(model, latents, t, states, torch.tensor([5, 33, 70]))
    assert (other[1] - ref[1]).abs().max() > 1e-3


def test_the_fixed_shape_velocity_is_z_velocity_guided_and_not_and_trains_the_same_lora_gradients():
    """z_velocity_fixed on the conditioning tuple equals z_velocity on the caption lists (guided, with the
    negative prompt's single row broadcast, and not), and gives the same gradients to the transformer's weights."""
    from ddpo_tpu.models.z_image import caption_list, z_velocity, z_velocity_fixed

    model = _tiny_transformer()
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(64)[None, :] < torch.tensor([[3], [33], [64]])
    states = torch.randn(3, 64, 32, generator=g) * mask[..., None]
    neg_mask = torch.arange(64)[None, :] < torch.tensor([[7]])
    neg_states = torch.randn(1, 64, 32, generator=g) * neg_mask[..., None]
    latents = torch.randn(3, 16, 8, 8, generator=g)
    timestep = torch.tensor([900.0, 500.0, 100.0])
    caps, neg_caps = caption_list(states, mask), caption_list(neg_states, neg_mask) * 3
    with torch.no_grad():
        for s in (1.0, 5.0):
            ref = z_velocity(model, latents, timestep, caps, neg_caps, s)
            ours = z_velocity_fixed(model, latents, timestep, (states, mask), (neg_states, neg_mask), s)
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    grads = []
    for fn in (lambda: z_velocity(model, latents, timestep, caps, neg_caps, 5.0, detach_uncond=True),
               lambda: z_velocity_fixed(model, latents, timestep, (states, mask), (neg_states, neg_mask), 5.0,
                                        detach_uncond=True)):
        model.zero_grad()
        (fn() ** 2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "cap_pad_token" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
