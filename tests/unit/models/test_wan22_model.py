"""Wan 2.2 in the Wan family (models/wan.py, families/wan.py, catalog/wan_memory.py): the two tiny builds loaded
through from_pretrained (and by diffusers' own WanPipeline), the expert chosen per step, the ODE and the SDE step with
its log-prob against the references, LoRA on the experts model.train_experts names, checkpoint state of both
adapters, and the full-size configs' memory figures.

References, written here from their code, not from ours:
* diffusers 0.42.1 ``WanPipeline.__call__`` (pipelines/wan/pipeline_wan.py:585-611): the boundary timestep
  ``boundary_ratio * scheduler.config.num_train_timesteps``; ``transformer`` when ``t >= boundary_timestep``, else
  ``transformer_2``; with ``expand_timesteps`` a timestep per video token. The ODE test runs that ``__call__`` itself,
  with its scheduler's step replaced by flow_grpo's deterministic branch (``sample + dt * model_output``) so the
  trajectory is ours to compare.
* yifan123/flow_grpo@9745241 ``flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py::sde_step_with_logprob``
  (tests/parity/test_wan_parity.py holds it as ``ref_sde_step_with_logprob``) with the expert picked per step as
  X-GenGroup/Flow-Factory@a0b2bc5 ``src/flow_factory/models/wan/wan2_t2v.py::forward`` (lines 474-486: the same
  ``t >= boundary_timestep`` rule, ``transformer`` above it, ``transformer_2`` below) picks it for training.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from ddpo_tpu.config.compose import ConfigError, compose_and_validate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parity"))
from test_wan_parity import ref_sde_step_with_logprob  # noqa: E402  flow_grpo's Wan step, written from its code

STEPS, GUIDANCE = 6, 4.5
SMOKE = ["+experiment=wan22_grpo_smoke", f"sample.num_steps={STEPS}"]


def _family(model_cache, *overrides, trained_adapter=True):
    from tests.helpers import family_with_trained_adapter

    from ddpo_tpu.families import load_family
    from ddpo_tpu.runtime import make_runtime

    over = [*SMOKE, f"model.cache_dir={model_cache}", *overrides]
    if trained_adapter:
        return family_with_trained_adapter(over)
    v = compose_and_validate(over)
    torch.manual_seed(0)
    return load_family(v.cfg, make_runtime(v.cfg))


@pytest.fixture(scope="module")
def a14b(model_cache):
    return _family(model_cache, f"sample.guidance_scale={GUIDANCE}", "train.cfg=true")


@pytest.fixture(scope="module")
def ti2v(model_cache):
    return _family(model_cache, "model=tiny_wan22_ti2v", "model.resolution=64")


def _euler_on_schedule(unipc):
    """A scheduler for WanPipeline.__call__: UniPC's timesteps and sigmas, flow_grpo's deterministic step."""
    from diffusers import UniPCMultistepScheduler

    class EulerOnUniPC(UniPCMultistepScheduler):
        def step(self, model_output, timestep, sample, return_dict=False, **kwargs):
            i = int((self.timesteps == timestep).nonzero()[0])
            return (sample.float() + (self.sigmas[i + 1] - self.sigmas[i]) * model_output.float(),)

    return EulerOnUniPC.from_config(unipc.config)


def _pipeline(fam):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    c = fam.c
    two = c.transformer_2 is not None
    return WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                       transformer=fam.model.high if two else fam.model, transformer_2=fam.model.low if two else None,
                       scheduler=UniPCMultistepScheduler.from_config(c.scheduler.config),
                       boundary_ratio=c.boundary_ratio, expand_timesteps=c.expand_timesteps)


def _calls(*modules):
    seen = []
    hooks = [m.register_forward_hook(lambda mod, a, o, k=k: seen.append(k)) for k, m in enumerate(modules)]
    return seen, hooks


def test_the_builds_load_through_from_pretrained_with_wan22s_layout(model_cache):
    from diffusers import WanPipeline, WanTransformer3DModel

    from ddpo_tpu.models.wan import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, ensure_tiny_wan22, load_wan

    path = ensure_tiny_wan22(model_cache)
    index = json.loads((path / "model_index.json").read_text())
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"] and index["boundary_ratio"] == 0.875
    c = load_wan(str(path))
    assert isinstance(c.transformer_2, WanTransformer3DModel) and c.boundary_timestep == 875.0
    assert not torch.equal(c.transformer.proj_out.weight, c.transformer_2.proj_out.weight)  # two experts
    pipe = WanPipeline.from_pretrained(str(path))  # diffusers reads the same directory
    assert torch.equal(pipe.transformer_2.proj_out.weight, c.transformer_2.proj_out.weight)

    c5 = load_wan(str(ensure_tiny_wan22(model_cache, ti2v=True)))
    vc = c5.vae.config
    assert c5.transformer_2 is None and c5.expand_timesteps and c5.boundary_timestep is None
    assert (vc.z_dim, vc.patch_size, vc.in_channels, vc.is_residual) == (48, 2, 12, True)
    assert list(vc.latents_mean) == WAN22_LATENTS_MEAN and list(vc.latents_std) == WAN22_LATENTS_STD
    assert c5.scale_factors == (4, 16) and c5.latent_shape(5, 64, 64) == (48, 2, 4, 4)
    assert c5.scheduler.config.flow_shift == 5.0


def test_the_expert_switches_where_wanpipeline_switches(a14b):
    """t >= 875 is the high-noise expert's: with shift 3 and 6 steps the schedule's timesteps are 999, 937 | 857 ..."""
    high = a14b._high_steps(a14b.tables)
    assert high.tolist() == (a14b.tables.timesteps >= 875).tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize("which", ["a14b", "ti2v"])
def test_the_ode_with_experts_equals_wanpipelines_call(which, request):
    """WanPipeline.__call__ itself (its expert choice, its guidance, its per-token timesteps) with the ODE step, and
    our deterministic steps from the same latents: the same final latents, each expert called on its steps."""
    fam = request.getfixturevalue(which)
    pipe = _pipeline(fam)
    pipe.scheduler = _euler_on_schedule(pipe.scheduler)
    prompts = ["a cat", "a dog riding a bike"]
    cond, uncond = fam.encode(prompts), fam.encode([""] * 2)
    init = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(1))
    frames, h, w = fam.video
    guided = fam.cfg.sample.guidance_scale > 1
    experts = (fam.model.high, fam.model.low) if which == "a14b" else (fam.model,)
    seen, hooks = _calls(*experts)
    try:
        with torch.no_grad():
            ref = pipe(prompt_embeds=cond[0], negative_prompt_embeds=uncond[0] if guided else None,
                       guidance_scale=fam.cfg.sample.guidance_scale, num_inference_steps=STEPS, latents=init.clone(),
                       height=h, width=w, num_frames=frames, output_type="latent", return_dict=False)[0]
            theirs_calls, seen[:] = list(seen), []
            step = fam.make_denoise_step(None, deterministic=True)
            x = init
            for i in range(STEPS):
                x, _ = step(x, torch.full((2,), i, dtype=torch.long), torch.zeros_like(x), cond,
                            uncond if guided else None)
    finally:
        for hk in hooks:
            hk.remove()
    assert seen == theirs_calls
    if which == "a14b":  # cond + uncond on each of 2 high steps, then 4 low ones
        assert seen == [0] * 4 + [1] * 8
    torch.testing.assert_close(x, ref.float(), rtol=1.3e-6, atol=1e-5)
    assert float((x - init).abs().mean()) > 1e-2


def test_sde_steps_and_training_log_probs_equal_flow_grpos_step_with_the_expert_per_step(a14b):
    """Sampling: flow_grpo's Wan SDE step on the expert's guided velocity (the expert per step as WanPipeline /
    Flow-Factory pick it), step by step. Training: a batch whose rows sit on both sides of the boundary scores each
    row as the reference scores it with its own expert."""
    fam, pipe = a14b, _pipeline(a14b)
    pipe.scheduler.set_timesteps(STEPS)
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    prompts = ["a cat", "a dog riding a bike"]
    cond, uncond = fam.encode(prompts), fam.encode([""] * 2)

    def ref_velocity(x, t):
        model = pipe.transformer if t >= boundary else pipe.transformer_2
        ts = t.expand(x.shape[0])
        c = model(hidden_states=x, timestep=ts, encoder_hidden_states=cond[0], return_dict=False)[0]
        u = model(hidden_states=x, timestep=ts, encoder_hidden_states=uncond[0], return_dict=False)[0]
        return u + GUIDANCE * (c - u)

    x = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(2))
    step, lat = fam.make_denoise_step(None), [x]
    with torch.no_grad():
        for i, t in enumerate(pipe.scheduler.timesteps):
            torch.manual_seed(10 + i)  # the reference's randn_tensor draws from the global generator
            z = torch.randn(x.shape)
            torch.manual_seed(10 + i)
            ref_x, ref_lp, _, _ = ref_sde_step_with_logprob(pipe.scheduler, ref_velocity(x, t).float(), t.unsqueeze(0),
                                                            x.float())
            ours_x, ours_lp = step(x, torch.full((2,), i, dtype=torch.long), z, cond, uncond)
            torch.testing.assert_close(ours_x, ref_x, rtol=1.3e-6, atol=1e-5)
            torch.testing.assert_close(ours_lp, ref_lp, rtol=1.3e-6, atol=1e-5)
            x = ref_x
            lat.append(x)
    # training: row 0 at step 1 (high expert), row 1 at step 3 (low expert), in one batch
    score = fam.make_score_step(None)
    idx = torch.tensor([1, 3])
    cur = torch.stack([lat[1][0], lat[3][1]])
    nxt = torch.stack([lat[2][0], lat[4][1]])
    ours = score(cur, idx, nxt, cond, uncond)
    for row, j in enumerate(idx.tolist()):
        t = pipe.scheduler.timesteps[j]
        v = ref_velocity(cur[row:row + 1].expand(2, -1, -1, -1, -1), t)[row:row + 1]
        _, ref_lp, ref_mean, ref_std = ref_sde_step_with_logprob(pipe.scheduler, v.float(), t.unsqueeze(0),
                                                                 cur[row:row + 1].float(),
                                                                 prev_sample=nxt[row:row + 1].float())
        torch.testing.assert_close(ours.log_prob[row:row + 1], ref_lp, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(ours.mean[row:row + 1], ref_mean, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("experts", [["high", "low"], ["low"]])
def test_lora_trains_only_the_named_experts(model_cache, experts):
    fam = _family(model_cache, f"model.train_experts=[{','.join(experts)}]", trained_adapter=False)
    for name in ("high", "low"):
        lora = [p for n, p in fam.model.expert(name).named_parameters() if "lora" in n]
        assert bool(lora) == (name in experts) and all(p.requires_grad for p in lora)
        assert not any(p.requires_grad for n, p in fam.model.expert(name).named_parameters() if "lora" not in n)
    cond = fam.encode(["a cat"])
    x = torch.randn(1, *fam.latent_shape, generator=torch.Generator().manual_seed(3))
    score = fam.make_score_step(None)
    for j, side in ((0, "high"), (4, "low")):  # step 0: timestep 999, the high expert's; step 4: 600, the low one's
        fam.model.zero_grad(set_to_none=True)
        out = score(x, torch.tensor([j]), x * 0.9, cond, None)
        if side not in experts:
            assert not out.log_prob.requires_grad  # nothing this step calls trains
            continue
        (out.mean.sum() + out.log_prob.sum()).backward()
        for name in ("high", "low"):
            grads = [p.grad for n, p in fam.model.expert(name).named_parameters() if "lora_B" in n]
            assert any(g is not None and float(g.abs().sum()) > 0 for g in grads) == (name == side)


def test_checkpoint_state_keeps_both_adapters_and_loads_back(model_cache, a14b):
    state = {k: v.clone() for k, v in a14b.trainable_state().items()}
    assert {k.split(".", 1)[0] for k in state} == {"high", "low"}
    assert sum(k.startswith("high.") for k in state) == sum(k.startswith("low.") for k in state) > 0
    fresh = _family(model_cache, f"sample.guidance_scale={GUIDANCE}", "train.cfg=true", trained_adapter=False)
    assert not all(torch.equal(state[k], v) for k, v in fresh.trainable_state().items())
    fresh.load_trainable_state(state)
    assert all(torch.equal(state[k], v) for k, v in fresh.trainable_state().items())
    with pytest.raises(RuntimeError, match="experts this run does not train"):
        only_high = _family(model_cache, "model.train_experts=[high]", trained_adapter=False)
        only_high.load_trainable_state(state)
    with fresh.reference(), torch.no_grad():  # both adapters off: the frozen experts
        x = torch.randn(1, *fresh.latent_shape, generator=torch.Generator().manual_seed(4))
        off = fresh.velocity(x, torch.tensor([4]), fresh.encode(["a cat"]), None)
    on = fresh.velocity(x, torch.tensor([4]), fresh.encode(["a cat"]), None).detach()
    assert float((on - off).abs().max()) > 0


def test_unknown_expert_names_are_refused_at_compose_time():
    with pytest.raises(ConfigError, match="model.train_experts"):
        compose_and_validate([*SMOKE, "model.train_experts=[mid]"])


def test_memory_counts_both_experts_and_ti2vs_tokens():
    from ddpo_tpu.catalog import wan_memory as wm

    real = ["+experiment=wan_grpo_smoke", "train.mixed_precision=bf16", "train.activation_checkpointing=true"]
    a14b = compose_and_validate([*real, "model=wan22_t2v_a14b", "tpu_topology=v6e-8", "tpu_topology.mesh.fsdp=8",
                                 "tpu_topology.mesh.dp=1", "train.batch_size=1", "model.train_experts=[low]"]).cfg.model
    c = wm.transformer_config(a14b)
    both = a14b.model_copy(update={"train_experts": None})
    one_expert = wm.transformer_parameters(c) / 8 * 2 / 2**30
    lora = wm.lora_values(a14b, c) * 20 / 2**30
    assert wm.experts(a14b) == 2 and wm.trained_experts(a14b) == 1 and wm.trained_experts(both) == 2
    # the second trained expert's LoRA state is the whole difference; the frozen second expert is resident either way
    assert math.isclose(wm.resident_gib(both, 8, "bfloat16") - wm.resident_gib(a14b, 8, "bfloat16"), lora)
    assert one_expert > 3 and lora > 5  # 14B / 8 chips in bf16; rank 64 on 10 targets x 40 blocks
    with pytest.raises(ConfigError, match="tpu_topology"):  # both experts trained do not fit a v6e chip's 32 GiB
        compose_and_validate([*real, "model=wan22_t2v_a14b", "tpu_topology=v6e-8", "tpu_topology.mesh.fsdp=8",
                              "tpu_topology.mesh.dp=1", "train.batch_size=1"])
    ti2v = compose_and_validate([*real, "model=wan22_ti2v_5b", "tpu_topology=v6e-8", "train.batch_size=2",
                                 "train.gradient_accumulation_steps=16"]).cfg.model
    c5 = wm.transformer_config(ti2v)
    assert wm.tokens(ti2v) == 9 * 15 * 15  # 33 frames -> 9 latent frames; 480 px / (16 x 2) = 15
    assert wm.transformer_parameters(c5) == 4_999_787_712  # WanTransformer3DModel(**config) on the meta device
    with torch.device("meta"):
        from diffusers import AutoencoderKLWan

        from ddpo_tpu.models.wan import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD

        vae = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12,
                               patch_size=2, is_residual=True, scale_factor_spatial=16,
                               latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD)
    assert round(sum(p.numel() for p in vae.parameters()) / 1e9, 3) == wm.VAE22_BILLIONS


def test_ti2v_frames_off_its_32_pixel_grid_are_refused_with_the_fix(model_cache):
    from ddpo_tpu.models.loading import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"multiples of 32 pixels .* Fix: model.resolution=64"):
        _family(model_cache, "model=tiny_wan22_ti2v", "model.resolution=48", trained_adapter=False)


def test_a_mixed_batch_gives_each_row_its_experts_velocity_on_both_paths(a14b, monkeypatch):
    """Rows on both sides of the boundary: eager runs each expert on its own rows; a graph-compiling runtime runs both
    on every row and selects per row on the device. Both equal each row's expert called alone."""
    fam = a14b
    cond, uncond = fam.encode(["a cat", "a dog", "a horse"]), fam.encode([""] * 3)
    x = torch.randn(3, *fam.latent_shape, generator=torch.Generator().manual_seed(5))
    idx = torch.tensor([0, 3, 1])  # high, low, high
    with torch.no_grad():
        alone = torch.cat([fam.velocity(x[r:r + 1], idx[r:r + 1], (cond[0][r:r + 1],), (uncond[0][r:r + 1],))
                           for r in range(3)])
        eager = fam.velocity(x, idx, cond, uncond)
        monkeypatch.setattr(fam.rt, "compiles_graphs", True)
        selected = fam.velocity(x, idx, cond, uncond)
    # float32 rounding differs with the batch size (1 row vs 2 or 3), hence atol 1e-5
    torch.testing.assert_close(eager, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(selected, alone, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and the experts differ: a row given the other expert would not match
        wrong = fam.velocity(x[1:2], torch.tensor([0]), (cond[0][1:2],), (uncond[0][1:2],))
    assert float((wrong - alone[1:2]).abs().max()) > 1e-3


def test_each_velocity_is_one_forward_of_ddps_wrapper_which_expects_the_idle_experts_lora(model_cache):
    """Two experts on several processes (runtime/distributed.py prepare_model, as torchrun's ranks wrap the model):
    every velocity is one forward of the DDP wrapper (WanExperts.forward runs the family's expert calls), so its
    forward arms the gradient reduction; a step that calls one expert leaves the other's LoRA out of the graph, which
    DDP's reducer, told by WanExperts.ddp_find_unused_parameters, expects. Without it the next step raises (the check
    can fail). One gloo process (world size 1: the reducer's bookkeeping is the same as on many)."""
    import types

    import torch.distributed as dist

    from ddpo_tpu.runtime.distributed import DistributedRuntime

    fam = _family(model_cache, trained_adapter=False)
    cond = fam.encode(["a cat", "a dog"])
    x = torch.randn(2, *fam.latent_shape, generator=torch.Generator().manual_seed(6))
    lora = {name: [p for n, p in fam.model.expert(name).named_parameters() if "lora_B" in n]
            for name in ("high", "low")}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rt = types.SimpleNamespace(fsdp=1, process_count=2, device=torch.device("cpu"), _ddp=None)
        calls = []
        fam.denoiser = DistributedRuntime.prepare_model(rt, fam.model)  # type: ignore[arg-type]
        fam.denoiser.register_forward_pre_hook(lambda mod, args: calls.append(1))
        assert fam.denoiser.find_unused_parameters
        score = fam.make_score_step(None)
        # high only, low only, then a mixed batch (each expert on its row): each a whole DDP iteration
        for idx, used in (([0, 1], {"high"}), ([3, 4], {"low"}), ([0, 4], {"high", "low"})):
            fam.model.zero_grad(set_to_none=True)
            out = score(x, torch.tensor(idx), x * 0.9, cond, None)
            out.log_prob.sum().backward()
            for name in ("high", "low"):
                assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in lora[name]) == (name in used)
        assert len(calls) == 3  # one forward of the wrapper per velocity
        # the reducer left to its default (every trained weight in every graph): the step after a one-expert step fails
        fam.denoiser = torch.nn.parallel.DistributedDataParallel(fam.model, broadcast_buffers=False)
        fam.model.zero_grad(set_to_none=True)
        score(x, torch.tensor([0, 1]), x * 0.9, cond, None).log_prob.sum().backward()
        with pytest.raises(RuntimeError, match="finished reduction"):
            score(x, torch.tensor([3, 4]), x * 0.9, cond, None).log_prob.sum().backward()
    finally:
        fam.denoiser = None
        dist.destroy_process_group()
