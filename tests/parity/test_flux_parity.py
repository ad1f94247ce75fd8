"""FLUX's Flow-GRPO step and log-prob (ddpo_tpu.families.flux) equal yifan123/flow_grpo's FLUX computation on the tiny
build, to float32 rounding (bit for bit on this machine's CPU).

The reference is written here from flow_grpo's code, in its order of operations, not from ours:
* ``flow_grpo/diffusers_patch/flux_pipeline_with_logprob.py::pipeline_with_logprob`` (sampling: FluxPipeline's
  latents and schedule -- sigmas linspace(1, 1/N, N) shifted by calculate_shift(image tokens) --, the guidance
  embedding, ``noise_pred.to(prompt_embeds.dtype)``, the SDE step on ``noise_pred.float()`` / ``latents.float()`` with
  ``t.unsqueeze(0).repeat(B)``, the step's output cast back to the latents' dtype; no generator reaches the step, so
  its noise comes from torch's global generator);
* ``scripts/train_flux.py::compute_log_prob`` (74db691; training: the recorded latents with ``timesteps[:, j] /
  1000``, the guidance embedding, zero txt_ids, the SDE step scoring ``next_latents``) and its KL term
  ``((mean - mean_ref)^2).mean(dim=(1, 2), keepdim=True) / (2 std_dev_t^2)``;
* ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py::sde_step_with_logprob`` (54809b5), which both call.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddpo_tpu.config.compose import compose_and_validate

STEPS, NOISE_LEVEL, GUIDANCE = 4, 0.9, 3.5  # flow_grpo's FLUX noise level and guidance (config/grpo.py pickscore_flux)


# --- the reference, from flow_grpo's code ----------------------------------------------------------------------------

def ref_sde_step_with_logprob(self, model_output, timestep, sample, noise_level=0.7, prev_sample=None, generator=None,
                              sde_type="sde"):
    from diffusers.utils.torch_utils import randn_tensor

    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    step_index = [self.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]
    sigma = self.sigmas[step_index].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_prev = self.sigmas[prev_step_index].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_max = self.sigmas[1].item()
    dt = sigma_prev - sigma
    assert sde_type == "sde"  # what train_flux.py runs (it passes no sde_type)
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    if prev_sample is None:
        variance_noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device,
                                      dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt))
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def ref_calculate_shift(image_seq_len, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


@torch.no_grad()
def ref_pipeline_with_logprob(self, prompt_embeds, pooled_prompt_embeds, latents, height, width, num_inference_steps,
                              guidance_scale, noise_level):
    """pipeline_with_logprob with prompt embeddings and packed latents given (its other inputs at their defaults)."""
    import numpy as np
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

    device = latents.device
    text_ids = torch.zeros(prompt_embeds.shape[1], 3).to(device=device, dtype=self.text_encoder.dtype)  # encode_prompt
    num_channels_latents = self.transformer.config.in_channels // 4
    latents, latent_image_ids = self.prepare_latents(latents.shape[0], num_channels_latents, height, width,
                                                     prompt_embeds.dtype, device, None, latents)
    sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    image_seq_len = latents.shape[1]
    mu = ref_calculate_shift(image_seq_len, self.scheduler.config.get("base_image_seq_len", 256),
                             self.scheduler.config.get("max_image_seq_len", 4096),
                             self.scheduler.config.get("base_shift", 0.5), self.scheduler.config.get("max_shift", 1.15))
    timesteps, num_inference_steps = retrieve_timesteps(self.scheduler, num_inference_steps, device, sigmas=sigmas,
                                                        mu=mu)
    if self.transformer.config.guidance_embeds:
        guidance = torch.full([1], guidance_scale, device=device, dtype=torch.float32)
        guidance = guidance.expand(latents.shape[0])
    else:
        guidance = None
    all_latents, all_log_probs = [latents], []
    self.scheduler.set_begin_index(0)
    for t in timesteps:
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        noise_pred = self.transformer(hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
                                      pooled_projections=pooled_prompt_embeds, encoder_hidden_states=prompt_embeds,
                                      txt_ids=text_ids, img_ids=latent_image_ids, joint_attention_kwargs=None,
                                      return_dict=False)[0]
        noise_pred = noise_pred.to(prompt_embeds.dtype)
        latents_dtype = latents.dtype
        latents, log_prob, _, _ = ref_sde_step_with_logprob(self.scheduler, noise_pred.float(),
                                                            t.unsqueeze(0).repeat(latents.shape[0]), latents.float(),
                                                            noise_level=noise_level)
        if latents.dtype != latents_dtype:
            latents = latents.to(latents_dtype)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    image = self._unpack_latents(latents, height, width, self.vae_scale_factor)
    image = (image / self.vae.config.scaling_factor) + self.vae.config.shift_factor
    image = self.vae.decode(image.to(dtype=self.vae.dtype), return_dict=False)[0]
    image = self.image_processor.postprocess(image, output_type="pt")
    return image, all_latents, latent_image_ids, text_ids, all_log_probs


def ref_compute_log_prob(transformer, pipeline, sample, j, config):
    """train_flux.py's compute_log_prob; ``transformer.module`` there is the accelerate-wrapped model: here the
    model."""
    packed_noisy_model_input = sample["latents"][:, j]
    device = packed_noisy_model_input.device
    dtype = packed_noisy_model_input.dtype
    if transformer.config.guidance_embeds:
        guidance = torch.tensor([config.sample.guidance_scale], device=device)
        guidance = guidance.expand(packed_noisy_model_input.shape[0])
    else:
        guidance = None
    model_pred = transformer(hidden_states=packed_noisy_model_input, timestep=sample["timesteps"][:, j] / 1000,
                             guidance=guidance, pooled_projections=sample["pooled_prompt_embeds"],
                             encoder_hidden_states=sample["prompt_embeds"],
                             txt_ids=torch.zeros(sample["prompt_embeds"].shape[1], 3).to(device=device, dtype=dtype),
                             img_ids=sample["image_ids"][0], return_dict=False)[0]
    return ref_sde_step_with_logprob(pipeline.scheduler, model_pred.float(), sample["timesteps"][:, j],
                                     sample["latents"][:, j].float(), prev_sample=sample["next_latents"][:, j].float(),
                                     noise_level=config.sample.noise_level)


# --- ours against it -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def family(model_cache):
    from ddpo_tpu.families import load_family
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate(["+experiment=flux_grpo_smoke", f"model.cache_dir={model_cache}",
                              f"sample.num_steps={STEPS}", f"sample.noise_level={NOISE_LEVEL}",
                              f"sample.guidance_scale={GUIDANCE}"])
    torch.manual_seed(0)
    fam = load_family(v.cfg, make_runtime(v.cfg))
    with torch.no_grad():  # a trained-looking adapter: peft's gaussian init leaves lora_B at zero
        for name, p in fam.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return fam


def reference_pipeline(fam):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    c = fam.c
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(c.scheduler.config), vae=c.vae,
                        text_encoder=c.text_encoder, tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
                        tokenizer_2=c.tokenizer_2, transformer=fam.model)


def test_sampling_steps_and_log_probs_equal_flow_grpos_flux_pipeline(family):
    from ddpo_tpu.models.flux import pack_latents

    fam, prompts = family, ["a cat", "a dog riding a bike", "a horse"]
    assert fam.latent_shape == (16, 64) and fam.num_steps == STEPS
    cond = fam.encode(prompts)
    init = pack_latents(torch.randn(3, 16, 8, 8, generator=torch.Generator().manual_seed(1)))
    torch.manual_seed(123)
    images, ref_latents, ref_ids, _, ref_log_probs = ref_pipeline_with_logprob(
        reference_pipeline(fam), cond[0], cond[1], init.clone(), 32, 32, STEPS, GUIDANCE, NOISE_LEVEL)
    torch.manual_seed(123)  # the reference's step noise: the global generator, one randn per step in order
    noise = [torch.randn(init.shape) for _ in range(STEPS)]
    step = fam.make_denoise_step(None)
    x, latents, log_probs = init, [init], []
    with torch.no_grad():
        for i in range(STEPS):
            x, lp = step(x, torch.full((3,), i, dtype=torch.long), noise[i], cond, ("ignored",))
            latents.append(x)
            log_probs.append(lp)
        ours = fam.decode(x)
    assert torch.equal(fam.img_ids, ref_ids)
    for i in range(STEPS):
        torch.testing.assert_close(latents[i + 1], ref_latents[i + 1], rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(log_probs[i], ref_log_probs[i], rtol=1.3e-6, atol=1e-5)
    assert torch.equal(ours, (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1))
    assert len({round(float(lp[0]), 3) for lp in log_probs}) == STEPS  # a step's log-prob depends on its sigma


def test_training_log_prob_mean_std_and_kl_equal_train_flux_compute_log_prob(family):
    from types import SimpleNamespace

    from ddpo_tpu.algorithms.grpo import kl_to_reference
    from ddpo_tpu.models.flux import pack_latents

    fam, prompts = family, ["a cat", "a dog riding a bike"]
    cond = fam.encode(prompts)
    init = pack_latents(torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(2)))
    pipe = reference_pipeline(fam)
    torch.manual_seed(7)
    _, lat, image_ids, _, log_probs = ref_pipeline_with_logprob(pipe, cond[0], cond[1], init, 32, 32, STEPS,
                                                                GUIDANCE, NOISE_LEVEL)
    lat = torch.stack(lat, dim=1)
    sample = {"latents": lat[:, :-1], "next_latents": lat[:, 1:], "timesteps": pipe.scheduler.timesteps.repeat(2, 1),
              "prompt_embeds": cond[0], "pooled_prompt_embeds": cond[1],
              "image_ids": image_ids.unsqueeze(0).repeat(2, 1, 1)}
    config = SimpleNamespace(sample=SimpleNamespace(guidance_scale=GUIDANCE, noise_level=NOISE_LEVEL))
    score = fam.make_score_step(None)
    for j in range(STEPS - 1):  # int(STEPS x 0.99): the trained steps
        idx = torch.full((2,), j, dtype=torch.long)
        ours = score(lat[:, j], idx, lat[:, j + 1], cond, None)
        _, ref_lp, ref_mean, ref_std = ref_compute_log_prob(fam.model, pipe, sample, j, config)
        torch.testing.assert_close(ours.log_prob, ref_lp, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(ours.mean, ref_mean, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(ours.std.reshape(-1), ref_std.reshape(-1))
        # at sampling's weights the recorded step scores as it was sampled (ratio 1)
        torch.testing.assert_close(ours.log_prob, log_probs[j], rtol=1.3e-6, atol=1e-5)
        # the KL term (train_flux.py computes it when beta > 0), against the adapter-off reference
        with fam.reference(), torch.no_grad():
            ref_model_mean = score(lat[:, j], idx, lat[:, j + 1], cond, None).mean
            _, _, theirs_ref_mean, _ = ref_compute_log_prob(fam.model, pipe, sample, j, config)
        kl = ((ref_mean - theirs_ref_mean) ** 2).mean(dim=(1, 2), keepdim=True) / (2 * ref_std**2)
        ours_kl = kl_to_reference(ours.mean, ref_model_mean, ours.std)
        torch.testing.assert_close(ours_kl, kl.reshape(-1), rtol=1e-5, atol=1e-9)
        assert float(ours_kl.detach().min()) > 0  # the adapter changes the step


def test_the_loss_gradient_reaches_the_adapter_through_one_pass(family):
    """No unconditional pass: the score step calls the transformer once per sample, with the guidance embedding."""
    fam = family
    calls = []
    hook = fam.model.register_forward_hook(lambda m, args, kwargs_out: calls.append(1))
    try:
        cond = fam.encode(["a cat", "a dog"])
        x = torch.randn(2, *fam.latent_shape)
        out = fam.make_score_step(None)(x, torch.zeros(2, dtype=torch.long), x * 0.9, cond, None)
        out.log_prob.sum().backward()
    finally:
        hook.remove()
    assert len(calls) == 1
    grads = [p.grad for n, p in fam.model.named_parameters() if "lora" in n]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)
    fam.model.zero_grad(set_to_none=True)
