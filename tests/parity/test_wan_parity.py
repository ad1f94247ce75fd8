"""Wan's Flow-GRPO step, log-prob, guidance and schedule (ddpo_tpu.families.wan, diffusion/wan_sde.py) equal
yifan123/flow_grpo's Wan computation on the tiny build, to float32 rounding.

The reference is written here from flow_grpo's code (upstream history as mirrored by zhtmike/flow_grpo at 9745241,
the Wan files added by 11caf1b "wan2_1"), in its order of operations, not from ours:
* ``flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py::sde_step_with_logprob`` (lines 10-84): std_dev_t =
  sigma_min + (sigma_max - sigma_min) sigma with sigma_max = sigmas[1].item(), sigma_min = sigmas[-1].item(); the
  Flow-GRPO mean; noise from ``randn_tensor(model_output.shape, generator, device, model_output.dtype)``; the log-prob
  with the step's std std_dev_t sqrt(-dt); returns std_dev_t sqrt(-dt) (or std_dev_t and sqrt(-dt) apart);
* ``wan_pipeline_with_logprob`` (lines 86-373): ``scheduler.set_timesteps(N)`` (UniPC's int64 timesteps), the
  conditional pass, ``noise_pred.to(prompt_embeds.dtype)``, the unconditional pass when guidance_scale > 1 and
  ``uncond + g (cond - uncond)``, the step on ``noise_pred.float()`` / ``latents.float()`` at ``t.unsqueeze(0)``, and
  the decode ``latents / (1 / latents_std) + latents_mean`` -> ``vae.decode`` -> ``postprocess_video``;
* ``scripts/train_wan2_1.py::compute_log_prob`` (training, ``config.train.cfg``: the two passes on the recorded
  latents at ``timesteps[:, j]``, the step scoring ``next_latents`` with ``return_dt_and_std_dev_t=True``) and its KL
  term ``((mean - mean_ref)^2).mean(dim=(1, 2, 3), keepdim=True) / (2 (std_dev_t * dt_ref)^2)``, then ``torch.mean``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

STEPS, GUIDANCE = 4, 4.5  # guidance: flow_grpo's general_ocr_wan2_1 (config/grpo.py)


# --- the reference, from flow_grpo's code ----------------------------------------------------------------------------

def ref_sde_step_with_logprob(self, model_output, timestep, sample, prev_sample=None, generator=None,
                              determistic=False, return_dt_and_std_dev_t=False):
    from diffusers.utils.torch_utils import randn_tensor

    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    step_index = [self.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]
    self.sigmas = self.sigmas.to(sample.device)
    sigma = self.sigmas[step_index].view(-1, 1, 1, 1, 1)
    sigma_prev = self.sigmas[prev_step_index].view(-1, 1, 1, 1, 1)
    sigma_max = self.sigmas[1].item()
    sigma_min = self.sigmas[-1].item()
    dt = sigma_prev - sigma
    std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma
    prev_sample_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    if prev_sample is not None and generator is not None:
        raise ValueError("Cannot pass both generator and prev_sample.")
    if prev_sample is None:
        variance_noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device,
                                      dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    if determistic:
        prev_sample = sample + dt * model_output
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt))
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if return_dt_and_std_dev_t:
        return prev_sample, log_prob, prev_sample_mean, std_dev_t, torch.sqrt(-1 * dt)
    return prev_sample, log_prob, prev_sample_mean, std_dev_t * torch.sqrt(-1 * dt)


@torch.no_grad()
def ref_wan_pipeline_with_logprob(self, prompt_embeds, negative_prompt_embeds, latents, num_inference_steps,
                                  guidance_scale, determistic=False):
    """wan_pipeline_with_logprob with embeddings and initial latents given, output_type "pt", no KL reward."""
    do_cfg = guidance_scale > 1.0  # WanPipeline.do_classifier_free_guidance
    transformer_dtype = self.transformer.dtype
    prompt_embeds = prompt_embeds.to(transformer_dtype)
    negative_prompt_embeds = negative_prompt_embeds.to(transformer_dtype)
    self.scheduler.set_timesteps(num_inference_steps, device=latents.device)
    timesteps = self.scheduler.timesteps
    latents = latents.to(latents.device, torch.float32)  # prepare_latents with latents given
    all_latents, all_log_probs = [latents], []
    for i, t in enumerate(timesteps):
        latent_model_input = latents.to(transformer_dtype)
        timestep = t.expand(latents.shape[0])
        noise_pred = self.transformer(hidden_states=latent_model_input, timestep=timestep,
                                      encoder_hidden_states=prompt_embeds, attention_kwargs=None,
                                      return_dict=False)[0]
        noise_pred = noise_pred.to(prompt_embeds.dtype)
        if do_cfg:
            noise_uncond = self.transformer(hidden_states=latent_model_input, timestep=timestep,
                                            encoder_hidden_states=negative_prompt_embeds, attention_kwargs=None,
                                            return_dict=False)[0]
            noise_pred = noise_uncond + guidance_scale * (noise_pred - noise_uncond)
        latents, log_prob, _, _ = ref_sde_step_with_logprob(self.scheduler, noise_pred.float(), t.unsqueeze(0),
                                                            latents.float(), determistic=determistic)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    latents = latents.to(self.vae.dtype)
    latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, self.vae.config.z_dim, 1, 1, 1).to(
        latents.device, latents.dtype)
    latents_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, self.vae.config.z_dim, 1, 1, 1).to(
        latents.device, latents.dtype)
    latents = latents / latents_std + latents_mean
    video = self.vae.decode(latents, return_dict=False)[0]
    video = self.video_processor.postprocess_video(video, output_type="pt")
    return video, all_latents, all_log_probs


def ref_compute_log_prob(transformer, pipeline, sample, j, embeds, negative_embeds, config):
    if config.train.cfg:
        noise_pred_text = transformer(hidden_states=sample["latents"][:, j], timestep=sample["timesteps"][:, j],
                                      encoder_hidden_states=embeds, attention_kwargs=None, return_dict=False)[0]
        noise_pred_uncond = transformer(hidden_states=sample["latents"][:, j], timestep=sample["timesteps"][:, j],
                                        encoder_hidden_states=negative_embeds, attention_kwargs=None,
                                        return_dict=False)[0]
        noise_pred = noise_pred_uncond + config.sample.guidance_scale * (noise_pred_text - noise_pred_uncond)
    else:
        noise_pred = transformer(hidden_states=sample["latents"][:, j], timestep=sample["timesteps"][:, j],
                                 encoder_hidden_states=embeds, return_dict=False)[0]
    return ref_sde_step_with_logprob(pipeline.scheduler, noise_pred.float(), sample["timesteps"][:, j],
                                     sample["latents"][:, j].float(), prev_sample=sample["next_latents"][:, j].float(),
                                     return_dt_and_std_dev_t=True)


# --- ours against it -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def family(model_cache):
    from tests.helpers import family_with_trained_adapter

    return family_with_trained_adapter(["+experiment=wan_grpo_smoke", f"model.cache_dir={model_cache}",
                                        f"sample.num_steps={STEPS}", f"sample.guidance_scale={GUIDANCE}",
                                        "train.cfg=true"])


def reference_pipeline(fam):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    c = fam.c
    return WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=fam.model,
                       scheduler=UniPCMultistepScheduler.from_config(c.scheduler.config))


def test_the_shifted_schedule_is_unipcs_flow_sigmas_the_reference_steps_on(family):
    """Our device tables hold the sigmas and timesteps flow_grpo's pipeline gets from ``set_timesteps``: Wan 2.1's
    static shift of linspace(1, 1/1000, N + 1)[:-1], the first sigma 1 - 1e-6, a final 0, integer timesteps."""
    sched = reference_pipeline(family).scheduler
    sched.set_timesteps(STEPS)
    assert torch.equal(family.tables.sigmas, sched.sigmas.float())
    assert torch.equal(family.tables.timesteps, sched.timesteps.float()) and sched.timesteps.dtype == torch.int64
    s = np.linspace(1, 1 / 1000, STEPS + 1)[:-1]
    shifted = 3.0 * s / (1 + 2.0 * s)  # flow_shift 3 (Wan 2.1 T2V's scheduler config)
    shifted[0] -= 1e-6
    np.testing.assert_allclose(family.tables.sigmas.numpy(), np.append(shifted, 0.0), rtol=1e-6)
    np.testing.assert_array_equal(family.tables.timesteps.numpy(), (shifted * 1000).astype(np.int64))
    # sigma_max / sigma_min of the Wan step: the second sigma and the final 0
    assert float(family.tables.sigmas[-1]) == 0.0 and 0 < float(family.tables.sigmas[1]) < 1


def test_sampling_steps_log_probs_and_video_equal_flow_grpos_wan_pipeline(family):
    fam, prompts = family, ["a cat", "a dog riding a bike", "a horse"]
    assert fam.latent_shape == (16, 2, 4, 4) and fam.num_steps == STEPS and fam.video == (5, 32, 32)
    cond, uncond = fam.encode(prompts), fam.encode([""] * 3)
    init = torch.randn(3, *fam.latent_shape, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(123)
    video, ref_latents, ref_log_probs = ref_wan_pipeline_with_logprob(reference_pipeline(fam), cond[0], uncond[0],
                                                                      init.clone(), STEPS, GUIDANCE)
    torch.manual_seed(123)  # the reference's step noise: the global generator, one randn per step in order
    noise = [torch.randn(init.shape) for _ in range(STEPS)]
    step = fam.make_denoise_step(None)
    x, latents, log_probs = init, [init], []
    with torch.no_grad():
        for i in range(STEPS):
            x, lp = step(x, torch.full((3,), i, dtype=torch.long), noise[i], cond, uncond)
            latents.append(x)
            log_probs.append(lp)
        ours = fam.decode(x)
    for i in range(STEPS):
        torch.testing.assert_close(latents[i + 1], ref_latents[i + 1], rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(log_probs[i], ref_log_probs[i], rtol=1.3e-6, atol=1e-5)
    assert video.shape == (3, 5, 3, 32, 32)  # (B, F, C, H, W) from postprocess_video
    expected = (video * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2)
    assert torch.equal(ours, expected)
    assert len({round(float(lp[0]), 3) for lp in log_probs}) == STEPS  # a step's log-prob depends on its sigma


def test_guidance_changes_the_step_as_the_reference(family):
    """Guidance on: the two passes and uncond + g (cond - uncond) (a wrong sign or order would not match above);
    guidance off: one conditional pass, as the reference at guidance_scale 1."""
    fam = family
    cond, uncond = fam.encode(["a red cat"]), fam.encode([""])
    x = torch.randn(1, *fam.latent_shape, generator=torch.Generator().manual_seed(3))
    idx = torch.zeros(1, dtype=torch.long)
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        guided, _ = fam.make_denoise_step(None)(x, idx, z, cond, uncond)
        torch.manual_seed(5)
        _, ref_latents, _ = ref_wan_pipeline_with_logprob(reference_pipeline(fam), cond[0], uncond[0], x.clone(),
                                                          STEPS, 1.0, determistic=True)
        ode, lp = fam.make_denoise_step(None, deterministic=True)(x, idx, z, cond, None)
    torch.testing.assert_close(ode, ref_latents[1], rtol=1.3e-6, atol=1e-5)  # the reference's determistic branch
    assert float(lp.abs().max()) == 0.0
    assert float((guided - ode).abs().mean()) > 1e-3


def test_training_log_prob_mean_std_and_kl_equal_train_wan_compute_log_prob(family):
    from types import SimpleNamespace

    from ddpo_tpu.algorithms.grpo import kl_to_reference

    fam, prompts = family, ["a cat", "a dog riding a bike"]
    cond, uncond = fam.encode(prompts), fam.encode([""] * 2)
    init = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(2))
    pipe = reference_pipeline(fam)
    torch.manual_seed(7)
    _, lat, log_probs = ref_wan_pipeline_with_logprob(pipe, cond[0], uncond[0], init, STEPS, GUIDANCE)
    lat = torch.stack(lat, dim=1)
    sample = {"latents": lat[:, :-1], "next_latents": lat[:, 1:], "timesteps": pipe.scheduler.timesteps.repeat(2, 1)}
    config = SimpleNamespace(sample=SimpleNamespace(guidance_scale=GUIDANCE), train=SimpleNamespace(cfg=True))
    score = fam.make_score_step(None)
    for j in range(int(STEPS * 0.99)):  # the trained steps (timestep_fraction 0.99)
        idx = torch.full((2,), j, dtype=torch.long)
        ours = score(lat[:, j], idx, lat[:, j + 1], cond, uncond)
        _, ref_lp, ref_mean, std_dev_t, dt = ref_compute_log_prob(fam.model, pipe, sample, j, cond[0], uncond[0],
                                                                  config)
        torch.testing.assert_close(ours.log_prob, ref_lp, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(ours.mean, ref_mean, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(ours.std.reshape(-1), (std_dev_t * dt).reshape(-1))
        # at sampling's weights the recorded step scores as it was sampled (ratio 1)
        torch.testing.assert_close(ours.log_prob, log_probs[j], rtol=1.3e-6, atol=1e-5)
        with fam.reference(), torch.no_grad():
            ref_model_mean = score(lat[:, j], idx, lat[:, j + 1], cond, uncond).mean
            _, _, theirs_ref_mean, _, dt_ref = ref_compute_log_prob(fam.model, pipe, sample, j, cond[0], uncond[0],
                                                                    config)
        kl = ((ref_mean - theirs_ref_mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * (std_dev_t * dt_ref) ** 2)
        ours_kl = kl_to_reference(ours.mean, ref_model_mean, ours.std)
        torch.testing.assert_close(ours_kl.mean(), torch.mean(kl), rtol=1e-5, atol=1e-9)
        assert float(ours_kl.detach().min()) > 0  # the adapter changes the step
        ours.log_prob.sum().backward()  # the gradient reaches the adapter through both passes
    grads = [p.grad for n, p in fam.model.named_parameters() if "lora" in n]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)
    fam.model.zero_grad(set_to_none=True)


def test_repeated_prompts_are_encoded_once_and_laid_out_per_row(family):
    """GRPO's batches hold each prompt group_size times: the family encodes each distinct prompt once, and every row
    gets what flow_grpo's per-row encoding gives it."""
    from ddpo_tpu.models.wan import encode_prompts_wan

    prompts = ["a cat", "a dog riding a bike", "a cat", "a cat"]
    seen = []
    hook = family.c.text_encoder.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            ours = family.encode(prompts)[0]
    finally:
        hook.remove()
    assert seen == [2]
    with torch.no_grad():
        torch.testing.assert_close(ours, encode_prompts_wan(family.c, prompts, "cpu"), rtol=1.3e-6, atol=1e-6)
