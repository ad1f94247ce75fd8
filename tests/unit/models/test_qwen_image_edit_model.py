"""model.family=qwen_image_edit on its tiny build (ddpo_tpu.models.qwen_image_edit, families/qwen_image_edit.py)
against diffusers' QwenImageEditPlusPipeline (0.42.1, pipelines/qwenimage/pipeline_qwenimage_edit_plus.py) and
yifan123/flow_grpo's edit script at 9dcdc35b211205511f171a4f3566e40786575bc3:

* the pipeline run whole on the same prompt, input pictures and initial latents (deterministic: the Euler ODE) and our
  family's ODE step from our own encoding equal at every step to float32 rounding: the pictures through the processor
  and Qwen2.5-VL in the edit template, through the VAE (mode, normalised, packed, appended), the RoPE shapes, the cut
  of the prediction. The pipeline's VAE_IMAGE_SIZE is set to the tiny build's (the family's one departure);
* the training log-prob equals flow_grpo's scripts/train_qwenimage_edit_plus.py::compute_log_prob:
  the transformer on ``cat([latents, image_latents], dim=1)``, the prediction cut to the generated tokens, then
  sd3_sde_with_logprob's step scoring ``next_latents`` (written from flow_grpo in tests/parity/test_flux_parity.py).
  At guidance 1 its ``neg + 1 (cond - neg)`` rescaled to the conditional norm is the conditional prediction, so the
  reference here makes the conditional pass only;
* true CFG (sample.guidance_scale > 1): the pipeline run whole with ``true_cfg_scale`` and ``negative_prompt=" "``
  equals our guided ODE steps (its negative encoded with the same pictures: ours is carried in each row's
  conditioning, families/qwen_image_edit.py), and the guided re-scored log-prob equals ``compute_log_prob``'s formula
  (both passes as one batch, cond first, states cut to the longest real length, the prediction cut to the generated
  tokens, ``neg + g (cond - neg)`` rescaled per token to the conditional norm, then the SDE step). flow_grpo passes
  ``txt_seq_lens`` too, which diffusers 0.42.1's transformer no longer takes (the mask carries it);
* the compose-time refusals of the edit family and of a reward that takes sources.
"""

from __future__ import annotations

import pytest
import torch

from tests.parity.test_flux_parity import ref_sde_step_with_logprob

STEPS, NOISE_LEVEL = 3, 1.2
GUIDANCE = 4.0  # the pipeline's default true_cfg_scale


@pytest.fixture(scope="module")
def fam(model_cache):
    from tests.helpers import family_with_trained_adapter

    return family_with_trained_adapter(["+experiment=qwen_image_edit_grpo_smoke", f"model.cache_dir={model_cache}",
                                        f"sample.num_steps={STEPS}", f"sample.sde_window.size={STEPS - 1}",
                                        f"sample.noise_level={NOISE_LEVEL}"])


def _pipeline(fam):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline

    c = fam.c
    return QwenImageEditPlusPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(c.scheduler.config),
                                     vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
                                     processor=c.processor, transformer=fam.model)


def _run_pipeline(fam, monkeypatch, prompt, init, **guidance):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from ddpo_tpu.models.qwen_image_edit import TINY_VAE_IMAGE_SIZE

    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", TINY_VAE_IMAGE_SIZE)
    pipe, seen, steps = _pipeline(fam), [], []
    hook = fam.model.register_forward_hook(lambda m, a, kw, out: seen.append((kw, out[0])), with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(image=fam.pictures([prompt])[0], prompt=prompt, height=32, width=32, num_inference_steps=STEPS,
                 latents=init.clone(), output_type="latent", **({"true_cfg_scale": 1.0} | guidance),
                 callback_on_step_end=lambda p, i, t, kw: steps.append(kw["latents"].clone()) or {})
    finally:
        hook.remove()
    return pipe, seen, steps


def test_ode_steps_equal_qwen_image_edit_plus_pipeline(fam, monkeypatch):
    prompt = "make the square red"
    init = torch.randn(1, *fam.latent_shape, generator=torch.Generator().manual_seed(1))
    pipe, seen, steps = _run_pipeline(fam, monkeypatch, prompt, init)
    assert len(steps) == STEPS and len(seen) == STEPS
    cond = fam.encode([prompt])
    kw = seen[0][0]
    n = int(cond[1][0].sum())  # the real conditioning tokens (ours are padded with mask 0)
    assert kw["encoder_hidden_states"].shape[1] == n > 8  # the pictures' tokens are in the conditioning
    torch.testing.assert_close(cond[0][0, :n], kw["encoder_hidden_states"][0], rtol=1e-5, atol=1e-5)
    assert not cond[0][0, n:].any()
    # the pictures' packed VAE latents appended after the 16 generated tokens, RoPE shapes in the pipeline's order
    torch.testing.assert_close(cond[2], kw["hidden_states"][:, init.shape[1]:], rtol=1e-5, atol=1e-6)
    assert kw["img_shapes"] == [[(1, 4, 4), *fam.image_shapes]] and len(fam.image_shapes) == 2
    step = fam.make_denoise_step(None, deterministic=True)
    x = init
    for i in range(STEPS):
        x, _ = step(x, torch.full((1,), i, dtype=torch.long), torch.zeros_like(x), cond, None)
        torch.testing.assert_close(x, steps[i], rtol=1e-5, atol=2e-5)


def _pipeline_on_schedule(fam):
    """The pipeline with its scheduler set as flow_grpo's sampler sets it (linspace sigmas, mu from the 16 generated
    tokens): the scheduler sd3_sde_with_logprob reads; and its timesteps."""
    import numpy as np
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_shift, retrieve_timesteps

    pipe = _pipeline(fam)
    cfg = pipe.scheduler.config
    mu = calculate_shift(16, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(pipe.scheduler, STEPS, "cpu", sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
    return pipe, timesteps


def test_training_log_prob_equals_flow_grpo_edit_compute_log_prob(fam, monkeypatch):
    prompts = ["make the square blue", "make the background dark"]
    cond = fam.encode(prompts)
    pipe, timesteps = _pipeline_on_schedule(fam)
    torch.testing.assert_close(fam.tables.timestep_at(torch.arange(STEPS)).float(), timesteps.float())
    gen = torch.Generator().manual_seed(3)
    lat = torch.randn(2, *fam.latent_shape, generator=gen)
    nxt = lat + 0.1 * torch.randn(lat.shape, generator=gen)
    score = fam.make_score_step(None)
    shapes = [[(1, 4, 4), *fam.image_shapes]] * 2
    for j in range(STEPS - 1):
        t = timesteps[j].expand(2)
        with torch.no_grad():
            pred = fam.model(hidden_states=torch.cat([lat, cond[2]], dim=1), timestep=t / 1000,
                             encoder_hidden_states=cond[0], encoder_hidden_states_mask=cond[1], img_shapes=shapes,
                             return_dict=False)[0][:, :lat.shape[1]]
            _, ref_lp, ref_mean, std = ref_sde_step_with_logprob(pipe.scheduler, pred.float(), t, lat.float(),
                                                                 prev_sample=nxt.float(), noise_level=NOISE_LEVEL)
        ours = score(lat, torch.full((2,), j, dtype=torch.long), nxt, cond, None)
        torch.testing.assert_close(ours.log_prob, ref_lp, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(ours.mean, ref_mean, rtol=1.3e-6, atol=1e-5)
    ours.log_prob.sum().backward()  # the gradient reaches the adapter through the pictures' tokens too
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in fam.model.named_parameters() if "lora" in n)
    fam.model.zero_grad(set_to_none=True)


def _guided(fam, monkeypatch, scale=GUIDANCE):
    """The family under a config sampling at ``scale`` (as evaluation swaps its own in: the family reads its cfg)."""
    monkeypatch.setattr(fam, "cfg", fam.cfg.model_copy(
        update={"sample": fam.cfg.sample.model_copy(update={"guidance_scale": scale})}))


def test_guided_ode_steps_equal_the_pipeline_with_true_cfg(fam, monkeypatch):
    """QwenImageEditPlusPipeline with true_cfg_scale 4 and negative_prompt " " (the conditional pass, then the
    negative one, whose states are the negative prompt encoded with the same pictures) against our guided ODE steps
    from our encoding, whose row carries its own negative."""
    prompt = "make the square red"
    init = torch.randn(1, *fam.latent_shape, generator=torch.Generator().manual_seed(1))
    pipe, seen, steps = _run_pipeline(fam, monkeypatch, prompt, init, true_cfg_scale=GUIDANCE, negative_prompt=" ")
    assert len(steps) == STEPS and len(seen) == 2 * STEPS  # two passes a step
    _guided(fam, monkeypatch)
    cond, uncond = fam.encode([prompt]), fam.encode([""])
    assert len(cond) == 5
    neg = seen[1][0]  # the pipeline's unconditional pass
    n = int(cond[4][0].sum())
    assert neg["encoder_hidden_states"].shape[1] == n > 8  # the negative holds the pictures' tokens
    torch.testing.assert_close(cond[3][0, :n], neg["encoder_hidden_states"][0], rtol=1e-5, atol=1e-5)
    assert not cond[3][0, n:].any()
    step = fam.make_denoise_step(None, deterministic=True)
    x, plain = init, init
    unguided = fam.make_denoise_step(None, deterministic=True)
    for i in range(STEPS):
        idx = torch.full((1,), i, dtype=torch.long)
        x, _ = step(x, idx, torch.zeros_like(x), cond, uncond)
        torch.testing.assert_close(x, steps[i], rtol=1e-5, atol=2e-5)
        plain, _ = unguided(plain, idx, torch.zeros_like(x), cond, None)
    assert (x - plain).abs().max() > 1e-3  # the guidance moved the samples: the check above could fail


def _flow_grpo_guided_log_prob(fam, pipe, cond, lat, nxt, t, j_scale):
    """flow_grpo's train_qwenimage_edit_plus.py::compute_log_prob (9dcdc35) written from it: the states and masks cut
    to the longest real length of both halves, one transformer call on ``cat([x, x])`` with ``cat([cond, neg])``,
    chunked, each cut to the generated tokens, ``comb = neg + g (cond - neg)`` times ``|cond| / |comb|`` over the
    channels, then sd3_sde_with_logprob's step scoring ``next_latents``."""
    embeds, mask, image_latents, neg_embeds, neg_mask = cond
    keep = int(torch.cat([mask.sum(1), neg_mask.sum(1)]).max())
    embeds, mask, neg_embeds, neg_mask = embeds[:, :keep], mask[:, :keep], neg_embeds[:, :keep], neg_mask[:, :keep]
    x = torch.cat([lat, image_latents], dim=1)
    shapes = [[(1, 4, 4), *fam.image_shapes]] * lat.shape[0]
    pred = fam.model(hidden_states=torch.cat([x, x]), timestep=torch.cat([t, t]) / 1000,
                     encoder_hidden_states_mask=torch.cat([mask, neg_mask]),
                     encoder_hidden_states=torch.cat([embeds, neg_embeds]), img_shapes=shapes * 2,
                     return_dict=False)[0]
    pos, neg = pred.chunk(2, dim=0)
    pos, neg = pos[:, :lat.shape[1]], neg[:, :lat.shape[1]]
    comb = neg + j_scale * (pos - neg)
    pred = comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    return ref_sde_step_with_logprob(pipe.scheduler, pred.float(), t, lat.float(), prev_sample=nxt.float(),
                                     noise_level=NOISE_LEVEL)


def test_guided_training_log_prob_equals_flow_grpo_edit_compute_log_prob(fam, monkeypatch):
    _guided(fam, monkeypatch)
    prompts = ["make the square blue", "make the background dark"]
    cond, uncond = fam.encode(prompts), fam.encode([""] * 2)
    pipe, timesteps = _pipeline_on_schedule(fam)
    gen = torch.Generator().manual_seed(3)
    lat = torch.randn(2, *fam.latent_shape, generator=gen)
    nxt = lat + 0.1 * torch.randn(lat.shape, generator=gen)
    score = fam.make_score_step(None)
    for j in range(STEPS - 1):
        with torch.no_grad():
            _, ref_lp, ref_mean, _ = _flow_grpo_guided_log_prob(fam, pipe, cond, lat, nxt, timesteps[j].expand(2),
                                                                GUIDANCE)
            plain = score(lat, torch.full((2,), j, dtype=torch.long), nxt, cond, None)
        ours = score(lat, torch.full((2,), j, dtype=torch.long), nxt, cond, uncond)
        torch.testing.assert_close(ours.log_prob, ref_lp, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(ours.mean, ref_mean, rtol=1.3e-6, atol=1e-5)
        assert (ours.mean - plain.mean).abs().max() > 1e-4  # guided differs from unguided
    ours.log_prob.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in fam.model.named_parameters() if "lora" in n)
    fam.model.zero_grad(set_to_none=True)


def test_rows_with_different_pictures_differ_in_their_unconditional_half(fam, monkeypatch):
    """The negative prompt is one text (" ") for every row, yet each row's negative states hold its own pictures;
    the same prompt text twice (GRPO's groups) repeats its row's negative; at guidance 1 no negative is encoded."""
    import numpy as np

    from ddpo_tpu.models.qwen_image import NEGATIVE_PROMPT
    from ddpo_tpu.models.qwen_image_edit import encode_edit_prompt

    assert len(fam.encode(["make the square red"])) == 3  # guidance 1: prompt, mask, picture latents only
    _guided(fam, monkeypatch)
    prompts = ["make the square red", "make the square blue", "make the square red"]
    pics = fam.pictures(prompts)
    assert not np.array_equal(np.asarray(pics[0][0]), np.asarray(pics[1][0]))  # the rows' pictures differ
    cond = fam.encode(prompts)
    neg_embeds, neg_mask = cond[3], cond[4]
    assert (neg_embeds[0] - neg_embeds[1]).abs().max() > 1e-4
    torch.testing.assert_close(neg_embeds[0], neg_embeds[2])
    e, m = encode_edit_prompt(fam.c, NEGATIVE_PROMPT, pics[1], fam.rt.device, fam.text_tokens)
    torch.testing.assert_close(neg_embeds[1], e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(neg_mask[1], m)
    assert (neg_embeds[1] - cond[0][1]).abs().max() > 1e-4  # the negative is not the prompt (flow_grpo's slip)


def test_a_compiling_runtime_feeds_the_vl_encoder_one_shape_and_the_same_conditioning(fam, monkeypatch):
    """On a runtime that compiles graphs (XLA) prompts of different lengths with their pictures reach Qwen2.5-VL as
    one batch padded to one length (the template's 64 + the family's text tokens), so each batch is the same encoder
    graph; the mask hides the padding: the states, mask and velocity equal the eager encoding's (each prompt at its
    own length), which test_ode_steps_equal_qwen_image_edit_plus_pipeline pins to the pipeline's unpadded call, and
    the velocity also equals the transformer's on the states cut to the real tokens (no padding at all)."""
    prompts = ["make the square red", "make the background dark"]
    seen = []
    hook = fam.c.text_encoder.register_forward_hook(
        lambda m, a, kw, out: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        eager = [fam.encode([p]) for p in prompts]
        monkeypatch.setattr(fam.rt, "compiles_graphs", True)
        fixed = [fam.encode([p]) for p in prompts]
        both = fam.encode(prompts)
    finally:
        hook.remove()
    real = [int(e[1][0].sum()) for e in eager]
    assert real[0] != real[1] and seen[0] == (1, 64 + real[0]) and seen[1] == (1, 64 + real[1])
    assert seen[2:] == [(1, 64 + fam.text_tokens)] * 2 + [(2, 64 + fam.text_tokens)]
    x = torch.randn(1, *fam.latent_shape, generator=torch.Generator().manual_seed(5))
    idx = torch.ones(1, dtype=torch.long)
    with torch.no_grad():
        for row, (e, f, n) in enumerate(zip(eager, fixed, real)):
            for a, b, c in zip(e, f, both):
                assert a.shape == b.shape == c[row:row + 1].shape
            torch.testing.assert_close(f[0], e[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(both[0][row:row + 1], e[0], rtol=1e-5, atol=1e-5)
            assert torch.equal(f[1], e[1]) and torch.equal(both[1][row:row + 1], e[1]) and torch.equal(f[2], e[2])
            unpadded = fam.velocity(x, idx, (e[0][:, :n], e[1][:, :n], e[2]), None)
            torch.testing.assert_close(fam.velocity(x, idx, f, None), unpadded, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fam.velocity(x, idx, tuple(t[row:row + 1] for t in both), None), unpadded,
                                       rtol=1e-5, atol=1e-5)


def test_true_cfg_composes_on_eager_and_on_torch_xla():
    """Guidance is not refused for the family (train.cfg as Qwen-Image's), nor torch_xla (its encoder inputs have one
    shape on a runtime that compiles graphs: test above; counted in tests/e2e/test_xla_families.py), nor several
    processes under FSDP2 or DDP (DDP was refused until its update equalled one process's:
    tests/e2e/test_distributed.py ddp_qwen_image_edit, runtime/distributed.py wrap_ddp)."""
    from ddpo_tpu.config.compose import compose_and_validate

    for topology, mesh in (("eager_cpu", []), ("cpu", []), ("cpu_spmd4", []), ("cpu_dist2", []),
                           ("cpu_dist2", ["tpu_topology.mesh.dp=1", "tpu_topology.mesh.fsdp=2"])):
        cfg = compose_and_validate(["+experiment=qwen_image_edit_grpo_smoke", "sample.guidance_scale=4.0",
                                    "train.cfg=true", f"tpu_topology={topology}", *mesh]).cfg
        assert cfg.sample.guidance_scale == 4.0 and cfg.train.cfg and cfg.tpu_topology.name == topology
        assert cfg.tpu_topology.mesh.fsdp == (2 if mesh else 1)


@pytest.mark.parametrize("overrides, key", [
    (["reward=jpeg_compressibility", "~reward.components"],
     "reward.name=jpeg_compressibility: model.family=qwen_image_edit"),
    (["reward.components=[{name: jpeg_compressibility, weight: 1.0}]"],  # no component sees the sources
     "reward.name=weighted: model.family=qwen_image_edit"),
    (["prompts.name=simple_animals", "prompts.path=null"], "prompts=simple_animals: model.family=qwen_image_edit"),
])
def test_edit_family_refusals(overrides, key):
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.problems import ConfigError

    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=qwen_image_edit_grpo_smoke", *overrides])
    assert key in str(e.value)


def test_a_reward_taking_sources_is_refused_without_an_edit_dataset():
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.problems import ConfigError

    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=qwen_image_grpo_smoke", "reward=edit_consistency"])
    assert "prompts=simple_animals: reward=edit_consistency scores each output against its prompt's source" \
        in str(e.value)


def test_the_full_size_config_fits_8_gpus_split_and_is_refused_on_v6e():
    """Qwen-Image-Edit-2509 at flow_grpo's settings (512 px, two 512 x 512 pictures: 3584 tokens an evaluation): the
    memory rule takes 8 x 80 GiB with the transformer split 8 ways and checkpointing (flow_grpo trains it on 8 GPUs
    with FSDP), and refuses a v6e chip (32 GiB) whatever the split: one sample's activations do not fit."""
    from ddpo_tpu.config import memory
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.problems import ConfigError

    real = ["+experiment=qwen_image_edit_grpo_smoke", "model=qwen_image_edit_2509", "train.mixed_precision=bf16",
            "sample.num_steps=10", "sample.batch_size=4", "sample.num_batches_per_epoch=16", "algorithm.group_size=16",
            "train.batch_size=1", "train.gradient_accumulation_steps=16", "sample.sde_window.size=2",
            "sample.sde_window.placement=random", "sample.sde_window.range=[0,5]"]
    split = compose_and_validate(real + ["tpu_topology=gpu-8", "tpu_topology.mesh.fsdp=8",
                                         "tpu_topology.mesh.dp=1"]).cfg
    assert memory.resident_gib(split) == pytest.approx(29.7, abs=0.1) and memory.activation_checkpointing(split)
    with pytest.raises(ConfigError) as e:
        compose_and_validate(real + ["tpu_topology=v6e-8", "tpu_topology.mesh.fsdp=8", "tpu_topology.mesh.dp=1"])
    # the memory rule's refusal only (a v6e-8 runs XLA SPMD, which the family's fixed shapes allow)
    problems = {p.key: p for p in e.value.problems}
    assert set(problems) == {"tpu_topology.name"}, problems
    assert "43.8 GiB of activations" in problems["tpu_topology.name"].reason
