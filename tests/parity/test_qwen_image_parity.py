"""Qwen-Image's Flow-GRPO sampling, step, log-prob, guidance, schedule and KL (ddpo_tpu.families.qwen_image,
models/qwen_image.py) equal yifan123/flow_grpo's Qwen-Image computation on the tiny build, to float32 rounding.

The reference is written here from flow_grpo's code (upstream history as mirrored by zhtmike/flow_grpo at 9745241; the
Qwen-Image files added by 4b13ec7 "support Qwen Image", the KL by 27b6ef8), in its order of operations, not from ours:
* ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py::sde_step_with_logprob`` (lines 11-93), the step the Qwen-Image
  pipeline and trainer import (qwenimage_pipeline_with_logprob.py:7, train_qwenimage.py:27): sde_type "sde", std_dev_t
  = sqrt(sigma / (1 - where(sigma == 1, sigmas[1], sigma))) noise_level, the Flow-GRPO mean, noise from
  ``randn_tensor(model_output.shape, generator, device, model_output.dtype)``, the log-prob with std_dev_t sqrt(-dt);
* ``qwenimage_pipeline_with_logprob.py::pipeline_with_logprob`` (lines 9-227): ``encode_prompt(prompt +
  negative_prompt)`` then ``chunk(2)`` (72-82); sigmas linspace(1, 1/N, N) and mu = calculate_shift(image tokens,
  the scheduler config's base/max seq len and shift) into ``retrieve_timesteps`` (97-113); without an SDE window the
  window is (0, T - 1): noise_level 0 on the last step (140-165); one transformer call on the batch of 2B (cond, then
  uncond) at ``t.expand(B).to(latents.dtype) / 1000`` (167-176), ``neg + g (cond - neg)`` rescaled by
  ``norm(cond, dim=-1) / norm(comb, dim=-1)`` (177-182), the step on ``noise_pred.float()`` / ``latents.float()``
  (184-190); the decode: unpack, ``latents / (1 / latents_std) + latents_mean``, ``vae.decode(...)[0][:, :, 0]``,
  ``postprocess`` (201-213);
* ``scripts/train_qwenimage.py::compute_log_prob`` (lines 204-242): the prompt states cut to the longest real prompt,
  the same batched guided velocity at ``timesteps / 1000``, the step scoring ``next_latents``; its KL (896-898):
  ``((mean - mean_ref) ** 2).mean(dim=(1, 2), keepdim=True) / (2 std_dev_t ** 2)``, then ``torch.mean``.

One adaptation to the installed diffusers (0.42): flow_grpo passes ``txt_seq_lens`` to the transformer, an argument
0.42 no longer has (it takes the text length for RoPE from the prompt states and masks their padding itself); the
reference here drops that argument and nothing else.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

# sd3_sde_with_logprob.py::sde_step_with_logprob, the step flow_grpo's Qwen-Image code imports: written from flow_grpo's
# code for FLUX's parity (its "sde" branch, the one the Qwen-Image code runs; the same lines 11-93 at 9745241)
from tests.parity.test_flux_parity import ref_sde_step_with_logprob

STEPS, GUIDANCE, NOISE_LEVEL = 4, 4.0, 1.2  # flow_grpo's pickscore_qwenimage: guidance_scale 4, noise_level 1.2


# --- the reference, from flow_grpo's code ----------------------------------------------------------------------------

def ref_guided(transformer, latents, timestep, embeds, mask, neg_embeds, neg_mask, img_shapes, true_cfg_scale):
    """The batched two-pass call and true CFG with the norm rescaling (pipeline 167-182, compute_log_prob 217-231)."""
    noise_pred = transformer(hidden_states=torch.cat([latents, latents], dim=0),
                             timestep=torch.cat([timestep, timestep], dim=0) / 1000, guidance=None,
                             encoder_hidden_states_mask=torch.cat([mask, neg_mask], dim=0),
                             encoder_hidden_states=torch.cat([embeds, neg_embeds], dim=0),
                             img_shapes=img_shapes * 2)[0]
    noise_pred, neg_noise_pred = noise_pred.chunk(2, dim=0)
    comb_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
    cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
    return comb_pred * (cond_norm / noise_norm)


@torch.no_grad()
def ref_pipeline_with_logprob(self, prompt, negative_prompt, latents, num_inference_steps, true_cfg_scale, height,
                              noise_level):
    """pipeline_with_logprob with the initial latents given, output_type "pt", no SDE window."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    width, batch_size, device = height, len(prompt), latents.device
    prompt_embeds, prompt_embeds_mask = self.encode_prompt(prompt=prompt + negative_prompt, device=device,
                                                           max_sequence_length=512)
    prompt_embeds, negative_prompt_embeds = prompt_embeds.chunk(2, dim=0)
    prompt_embeds_mask, negative_prompt_embeds_mask = prompt_embeds_mask.chunk(2, dim=0)
    latents = latents.to(device=device, dtype=prompt_embeds.dtype)  # prepare_latents with latents given
    img_shapes = [[(1, height // self.vae_scale_factor // 2, width // self.vae_scale_factor // 2)]] * batch_size
    sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    mu = calculate_shift(latents.shape[1], self.scheduler.config.get("base_image_seq_len", 256),
                         self.scheduler.config.get("max_image_seq_len", 4096),
                         self.scheduler.config.get("base_shift", 0.5), self.scheduler.config.get("max_shift", 1.15))
    timesteps, num_inference_steps = retrieve_timesteps(self.scheduler, num_inference_steps, device, sigmas=sigmas,
                                                        mu=mu)
    sde_window = (0, len(timesteps) - 1)
    all_latents, all_log_probs = [], []
    self.scheduler.set_begin_index(0)
    for i, t in enumerate(timesteps):
        if i < sde_window[0]:
            cur_noise_level = 0
        elif i == sde_window[0]:
            cur_noise_level = noise_level
            all_latents.append(latents)
        elif sde_window[0] < i < sde_window[1]:
            cur_noise_level = noise_level
        else:
            cur_noise_level = 0
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        noise_pred = ref_guided(self.transformer, latents, timestep, prompt_embeds, prompt_embeds_mask,
                                negative_prompt_embeds, negative_prompt_embeds_mask, img_shapes, true_cfg_scale)
        latents_dtype = latents.dtype
        latents, log_prob, _, _ = ref_sde_step_with_logprob(self.scheduler, noise_pred.float(),
                                                            t.unsqueeze(0).repeat(latents.shape[0]),
                                                            latents.float(), noise_level=cur_noise_level)
        if latents.dtype != latents_dtype:
            latents = latents.to(latents_dtype)
        if sde_window[0] <= i < sde_window[1]:
            all_latents.append(latents)
            all_log_probs.append(log_prob)
    final = self._unpack_latents(latents, height, width, self.vae_scale_factor).to(self.vae.dtype)
    latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, self.vae.config.z_dim, 1, 1, 1).to(
        final.device, final.dtype)
    latents_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, self.vae.config.z_dim, 1, 1, 1).to(
        final.device, final.dtype)
    final = final / latents_std + latents_mean
    image = self.vae.decode(final, return_dict=False)[0][:, :, 0]
    image = self.image_processor.postprocess(image, output_type="pt")
    return dict(images=image, all_latents=all_latents, all_log_probs=all_log_probs, final=latents,
                prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                prompt_embeds_mask=prompt_embeds_mask, negative_prompt_embeds_mask=negative_prompt_embeds_mask,
                timesteps=timesteps)


def ref_compute_log_prob(transformer, pipeline, sample, j, resolution, guidance_scale, noise_level):
    img_shapes = [[(1, resolution // pipeline.vae_scale_factor // 2,
                    resolution // pipeline.vae_scale_factor // 2)]] * len(sample["latents"][:, j])
    txt_seq_lens = sample["prompt_embeds_mask"].sum(dim=1).tolist()
    negative_txt_seq_lens = sample["negative_prompt_embeds_mask"].sum(dim=1).tolist()
    longest = max(txt_seq_lens + negative_txt_seq_lens)
    for key in ("prompt_embeds_mask", "negative_prompt_embeds_mask", "prompt_embeds", "negative_prompt_embeds"):
        sample[key] = sample[key][:, :longest]
    noise_pred = ref_guided(transformer, sample["latents"][:, j], sample["timesteps"][:, j],
                            sample["prompt_embeds"], sample["prompt_embeds_mask"], sample["negative_prompt_embeds"],
                            sample["negative_prompt_embeds_mask"], img_shapes, guidance_scale)
    return ref_sde_step_with_logprob(pipeline.scheduler, noise_pred.float(), sample["timesteps"][:, j],
                                     sample["latents"][:, j].float(), prev_sample=sample["next_latents"][:, j].float(),
                                     noise_level=noise_level)


# --- ours against it -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def family(model_cache):
    from tests.helpers import family_with_trained_adapter

    return family_with_trained_adapter(["+experiment=qwen_image_grpo_smoke", f"model.cache_dir={model_cache}",
                                        f"sample.num_steps={STEPS}", f"sample.guidance_scale={GUIDANCE}",
                                        f"sample.noise_level={NOISE_LEVEL}", f"sample.sde_window.size={STEPS - 1}",
                                        "train.cfg=true"])


def reference_pipeline(fam):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    c = fam.c
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(c.scheduler.config), vae=c.vae,
                             text_encoder=c.text_encoder, tokenizer=c.tokenizer, transformer=fam.model)


def test_the_shifted_schedule_is_the_one_the_reference_steps_on(family):
    """Our tables hold the sigmas and timesteps retrieve_timesteps sets: linspace(1, 1/N, N) shifted exponentially by
    mu(16 tokens) and stretched to end at shift_terminal 0.02 (Qwen-Image's scheduler config), then a final 0."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    sched = reference_pipeline(family).scheduler
    c = sched.config
    mu = calculate_shift(16, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(STEPS, sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
    assert torch.equal(family.tables.sigmas, sched.sigmas.float())
    assert torch.equal(family.tables.timesteps, sched.timesteps.float())
    # the formula, written out: exponential time shift, then the shift_terminal stretch
    s = np.linspace(1.0, 1 / STEPS, STEPS)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    stretched = 1 - (1 - shifted) / ((1 - shifted[-1]) / (1 - 0.02))
    np.testing.assert_allclose(family.tables.sigmas.numpy(), np.append(stretched, 0.0), rtol=1e-6)
    assert abs(float(family.tables.sigmas[STEPS - 1]) - 0.02) < 1e-6


def test_sampling_steps_log_probs_and_images_equal_flow_grpos_qwen_image_pipeline(family):
    """The loop's sampler (the SDE on steps 0..T-2, the ODE on the last, as the window (0, T - 1) runs it) against
    pipeline_with_logprob: every recorded latent and log-prob, the final latents and the decoded images."""
    from ddpo_tpu.diffusion.sampling import sample_trajectory
    from ddpo_tpu.runtime import make_runtime

    fam, prompts = family, ["a cat", "a dog riding a bike", "a horse"]
    assert fam.latent_shape == (16, 64) and fam.num_steps == STEPS and fam.latent_size == 8
    cond, uncond = fam.encode(prompts), fam.encode([""] * 3)
    init = torch.randn(3, *fam.latent_shape, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(123)
    ref = ref_pipeline_with_logprob(reference_pipeline(fam), prompts, [" "] * 3, init.clone(), STEPS, GUIDANCE, 32,
                                    NOISE_LEVEL)
    torch.manual_seed(123)  # the reference's step noise: the global generator, one randn per step in order
    noise = torch.stack([torch.randn(init.shape) for _ in range(STEPS)])
    with torch.no_grad():
        traj = sample_trajectory(fam.make_denoise_step(None), STEPS, cond, uncond, init, noise,
                                 rt=make_runtime(fam.cfg), sync_every=0, window=(0, STEPS - 1),
                                 ode_step=fam.make_denoise_step(None, deterministic=True))
        ours = fam.decode(traj.sample)
    assert traj.latents.shape == (3, STEPS, 16, 64)  # x_0 .. x_{T-1}: the window's steps
    for i in range(STEPS):
        torch.testing.assert_close(traj.latents[:, i], ref["all_latents"][i], rtol=1.3e-6, atol=1e-5)
    for i in range(STEPS - 1):
        torch.testing.assert_close(traj.log_probs[:, i], ref["all_log_probs"][i], rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(traj.sample, ref["final"], rtol=1.3e-6, atol=1e-5)  # after the last (ODE) step
    assert ref["images"].shape == (3, 3, 32, 32)
    expected = (ref["images"] * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(ours, expected)
    assert len({round(float(lp[0]), 3) for lp in traj.log_probs.unbind(1)}) == STEPS - 1  # each step its own sigma


def test_guidance_one_is_the_conditional_pass_and_guidance_rescales_as_the_reference(family):
    """At guidance 1 one conditional pass equals the reference's two-pass form (comb = cond up to rounding, norm
    ratio 1); at 4 the guided velocity keeps the conditional one's norm per token (the true-CFG normalisation)."""
    from ddpo_tpu.models.qwen_image import qwen_velocity

    fam = family
    cond, uncond = fam.encode(["a red cat"]), fam.encode([""])
    x = torch.randn(1, *fam.latent_shape, generator=torch.Generator().manual_seed(3))
    t = fam.tables.timestep_at(torch.zeros(1, dtype=torch.long))
    shapes = fam.shapes(1)
    with torch.no_grad():
        one = qwen_velocity(fam.model, x, t, *cond, shapes, *uncond, guidance_scale=1.0)
        plain = qwen_velocity(fam.model, x, t, *cond, shapes)
        ref_one = ref_guided(fam.model, x, t, *cond, *uncond, shapes, 1.0)
        guided = qwen_velocity(fam.model, x, t, *cond, shapes, *uncond, guidance_scale=GUIDANCE)
        ref_guided_v = ref_guided(fam.model, x, t, *cond, *uncond, shapes, GUIDANCE)
    assert torch.equal(one, plain)
    torch.testing.assert_close(one, ref_one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(guided, ref_guided_v, rtol=1.3e-6, atol=1e-6)
    torch.testing.assert_close(guided.norm(dim=-1), plain.norm(dim=-1), rtol=1e-5, atol=1e-6)
    assert float((guided - plain).abs().mean()) > 1e-3  # guidance changes the direction


def test_training_log_prob_mean_std_and_kl_equal_train_qwenimage_compute_log_prob(family):
    from ddpo_tpu.algorithms.grpo import kl_to_reference

    fam, prompts = family, ["a cat", "a dog riding a bike"]
    cond, uncond = fam.encode(prompts), fam.encode([""] * 2)
    init = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(2))
    pipe = reference_pipeline(fam)
    torch.manual_seed(7)
    ref = ref_pipeline_with_logprob(pipe, prompts, [" "] * 2, init, STEPS, GUIDANCE, 32, NOISE_LEVEL)
    lat = torch.stack(ref["all_latents"], dim=1)  # x_0 .. x_{T-1}: the window (0, T - 1)
    sample = {"latents": lat[:, :-1], "next_latents": lat[:, 1:],
              "timesteps": torch.stack(list(ref["timesteps"][:STEPS - 1])).unsqueeze(0).repeat(2, 1)}
    for key in ("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask"):
        sample[key] = ref[key]
    score = fam.make_score_step(None)
    for j in range(STEPS - 1):  # train_qwenimage.py: num_train_timesteps = num_steps - 1 without a window
        idx = torch.full((2,), j, dtype=torch.long)
        ours = score(lat[:, j], idx, lat[:, j + 1], cond, uncond)
        _, ref_lp, ref_mean, std_dev_t = ref_compute_log_prob(fam.model, pipe, dict(sample), j, 32, GUIDANCE,
                                                              NOISE_LEVEL)
        torch.testing.assert_close(ours.log_prob, ref_lp, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(ours.mean, ref_mean, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(ours.std.reshape(-1), std_dev_t.reshape(-1))  # std_dev_t, as SD 3's step
        # at sampling's weights the recorded step scores as it was sampled (ratio 1)
        torch.testing.assert_close(ours.log_prob, ref["all_log_probs"][j], rtol=1.3e-6, atol=1e-5)
        with fam.reference(), torch.no_grad():
            ref_model_mean = score(lat[:, j], idx, lat[:, j + 1], cond, uncond).mean
            _, _, theirs_ref_mean, _ = ref_compute_log_prob(fam.model, pipe, dict(sample), j, 32, GUIDANCE,
                                                            NOISE_LEVEL)
        kl = ((ref_mean - theirs_ref_mean) ** 2).mean(dim=(1, 2), keepdim=True) / (2 * std_dev_t ** 2)
        ours_kl = kl_to_reference(ours.mean, ref_model_mean, ours.std)
        torch.testing.assert_close(ours_kl.mean(), torch.mean(kl), rtol=1e-5, atol=1e-9)
        assert float(ours_kl.detach().min()) > 0  # the adapter changes the step
        ours.log_prob.sum().backward()  # the gradient reaches the adapter through the batched passes
    grads = [p.grad for n, p in fam.model.named_parameters() if "lora" in n]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)
    fam.model.zero_grad(set_to_none=True)
