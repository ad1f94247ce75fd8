"""The two ways ddpo_tpu cuts host time per step: compiled step functions (xla.step_compiler) and several timesteps
of a train batch in one forward/backward (train.timesteps_per_micro_step). Config rules, and the fused micro-step's
gradient against the unfused one (eager, in this process; the XLA paths are compared end to end in
test_training.py and test_xla.py)."""

from __future__ import annotations


import pytest
import torch

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.config.errors import ConfigError
from ddpo_tpu.config.rules import fused_timesteps

PARITY = ["+experiment=compressibility_parity"]


def problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        compose_and_validate(overrides)
    return {p.key: str(p) for p in info.value.problems}


def test_auto_fuses_what_fits_the_chip():
    """auto, by the activation estimate (XLA keeps every attention softmax for the backward: ~5.0 GiB per UNet
    evaluation in float32, 3.9 in bf16): SD 1.x at 512 px on a v6e chip (26 of 32 GiB for activations) with 2 samples
    x CFG per timestep fuses 1 timestep; with 1 sample per chip 2 (bf16) or 2 (float32, 20 GiB); 1 on CPU topologies;
    up to 10 for the small local models, whose activations are negligible."""
    v = compose_and_validate(PARITY)
    assert v.cfg.train.timesteps_per_micro_step == "auto" and v.cfg.xla.step_compiler == "dynamo"
    assert fused_timesteps(v.cfg) == 1
    assert next(r for r in v.report if r["constraint"] == "timesteps per micro-step")["effective"] == 1
    one_sample = [*PARITY, "train.batch_size=1", "train.gradient_accumulation_steps=8"]
    assert fused_timesteps(compose_and_validate(one_sample).cfg) == 2
    assert fused_timesteps(compose_and_validate([*one_sample, "train.mixed_precision=bf16"]).cfg) == 2
    assert fused_timesteps(compose_and_validate(["+experiment=smoke", "tpu_topology=cpu"]).cfg) == 1
    assert fused_timesteps(compose_and_validate([*PARITY, "parity=none", "model=sd14_topology"]).cfg) == 10
    assert fused_timesteps(compose_and_validate(["+experiment=smoke", "train.timesteps_per_micro_step=4"]).cfg) == 4


def test_auto_fuses_what_fits_the_chip_for_sd3(tmp_path):
    """SD 3.5 Medium has its own figure (~6 GiB per transformer evaluation in bf16 on XLA, most of it attention
    softmaxes): on a v6e chip (~15 of 32 GiB left beside the bf16 models and T5-XXL) one sample with CFG fits one
    timestep; without CFG at train time 2 evaluations fit, but auto takes a K that divides the 9 trained timesteps
    (1, 3, 9), so still 1. The tiny SD3 build is not held to SD 3.5's memory."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    sd35 = ["+experiment=flow_grpo_pickscore_sd35", f"prompts.file={prompts}"]
    assert fused_timesteps(compose_and_validate(sd35).cfg) == 1
    assert fused_timesteps(compose_and_validate([*sd35, "parity=none", "train.cfg=false"]).cfg) == 1
    found = problems([*sd35, "train.timesteps_per_micro_step=3"])
    assert "try train.timesteps_per_micro_step=1 (or auto)" in found["train.timesteps_per_micro_step"]
    assert fused_timesteps(compose_and_validate([*sd35, "parity=none", "model=tiny_sd3"]).cfg) == 9


def test_fused_timesteps_must_divide_the_trained_timesteps():
    found = problems([*PARITY, "parity=none", "model=sd14_topology", "train.timesteps_per_micro_step=3"])
    assert "train.timesteps_per_micro_step" in found
    assert "50 timesteps" in found["train.timesteps_per_micro_step"]
    assert "try train.timesteps_per_micro_step=2 (or auto)" in found["train.timesteps_per_micro_step"]
    compose_and_validate([*PARITY, "parity=none", "model=sd14_topology", "train.timesteps_per_micro_step=2"])


def test_fused_timesteps_must_fit_the_chip():
    """SD 1.x at 512 px on a v6e chip (32 GiB): 5 timesteps x 2 samples x 2 (CFG) do not fit; the fix names the
    largest K that divides 50 and fits."""
    found = problems([*PARITY, "train.timesteps_per_micro_step=5"])
    text = found["train.timesteps_per_micro_step"]
    assert "GiB of activations" in text and "(estimate)" in text and "try train.timesteps_per_micro_step=1" in text
    compose_and_validate([*PARITY, "train.timesteps_per_micro_step=1"])
    # one sample per chip: 2 timesteps fit, 5 do not
    one_sample = [*PARITY, "train.batch_size=1", "train.gradient_accumulation_steps=8"]
    compose_and_validate([*one_sample, "train.timesteps_per_micro_step=2"])
    found = problems([*one_sample, "train.timesteps_per_micro_step=5"])
    assert "try train.timesteps_per_micro_step=2" in found["train.timesteps_per_micro_step"]
    # the narrow SD 1.4-topology model is not held to SD's memory
    compose_and_validate([*PARITY, "parity=none", "model=sd14_topology", "train.timesteps_per_micro_step=10"])


@pytest.mark.parametrize("bad", ["xla.step_compiler=inductor", "train.timesteps_per_micro_step=0"])
def test_unknown_compiler_and_zero_fusion_are_refused(bad):
    assert bad.split("=")[0] in problems(["+experiment=smoke", bad])


def _micro_step_loss(unet, tables, K: int):
    from ddpo_tpu.ddpo.algorithm import DDPO
    from ddpo_tpu.ddpo.loop import make_micro_step_loss
    from ddpo_tpu.families.sd1 import SD1Family

    cfg = compose_and_validate(["+experiment=smoke", "model.lora.enabled=true"]).cfg
    family = SD1Family.__new__(SD1Family)  # the family's score step around this UNet and these tables
    family.cfg, family.model, family.tables = cfg, unet, tables
    return make_micro_step_loss(family.make_score_step(None), DDPO(cfg).loss)


def test_fused_micro_steps_give_the_unfused_gradient(tmp_path):
    """4 timesteps of a batch of 2 in one forward (batch 8), scaled as the trainer scales it, against 4 separate
    forwards: the same loss sum and the same gradient up to float32 summation order."""
    from ddpo_tpu.diffusion.ddim import DDIMTables
    from ddpo_tpu.models import ensure_tiny_model, load_components

    comps = load_components(str(ensure_tiny_model(tmp_path)), local_files_only=True)
    unet = comps.unet.float()
    unet.requires_grad_(True)
    T, B = 8, 2
    tables = DDIMTables.from_scheduler(comps.scheduler, T, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    cur, nxt = torch.randn(B, T, 4, 8, 8, generator=g), torch.randn(B, T, 4, 8, 8, generator=g)
    old_lp = torch.randn(B, T, generator=g) * 0.01
    idx = torch.stack([torch.randperm(T, generator=g) for _ in range(B)])
    emb = torch.randn(B, 77, 32, generator=g)
    adv = torch.randn(B, generator=g)

    def grads(K: int):
        unet.zero_grad(set_to_none=True)
        fn = _micro_step_loss(unet, tables, K)
        uncond = torch.zeros(B * K, 77, 32)
        total = 0.0
        for j in range(0, T, K):
            loss, kl, clipfrac = fn(cur, nxt, old_lp, idx, (emb,), adv, torch.arange(j, j + K), (uncond,))
            (loss / (T // K)).backward()  # the trainer's scaling with a window of T timesteps
            total += K * float(loss.detach())
        return total, torch.cat([p.grad.flatten() for p in unet.parameters()])

    loss1, g1 = grads(1)
    loss4, g4 = grads(4)
    assert loss4 == pytest.approx(loss1, rel=1e-6)
    assert float((g4 - g1).abs().max() / g1.abs().max()) < 1e-5
    assert float(g1.abs().max()) > 0
