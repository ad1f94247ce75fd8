"""The two ways ddpo_tpu cuts host time per step: compiled step functions (xla.step_compiler) and several timesteps
of a train batch in one forward/backward (train.timesteps_per_micro_step). Config rules, and the fused micro-step's
gradient against the unfused one (eager, in this process; the XLA paths are compared end to end in
test_training.py and test_xla.py)."""

from __future__ import annotations


import pytest
import torch

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.problems import ConfigError
from ddpo_tpu.config.memory import activation_checkpointing, fused_timesteps

PARITY = ["+experiment=compressibility_parity"]


def problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        compose_and_validate(overrides)
    return {p.key: str(p) for p in info.value.problems}


def test_auto_fuses_what_fits_the_chip():
    """auto, by the activation estimate (XLA keeps every attention softmax for the backward: ~5.0 GiB per UNet
    evaluation in float32, 3.9 in bf16; ~2.0 with activation checkpointing): SD 1.x at 512 px on a v6e chip (26 of 32
    GiB for activations) with 2 samples x CFG per timestep fuses 1 timestep, so auto checkpoints and fuses 2; with 1
    sample per chip 2 fit without it (bf16 too), so it stays off; 1 on CPU topologies; up to 10 for the small local
    models, whose activations are negligible."""
    v = compose_and_validate(PARITY)
    assert v.cfg.train.timesteps_per_micro_step == "auto" and v.cfg.xla.step_compiler == "dynamo"
    assert activation_checkpointing(v.cfg) and fused_timesteps(v.cfg) == 2
    assert report(v, "timesteps per micro-step") == 2 and report(v, "activation checkpointing") is True
    plain = compose_and_validate([*PARITY, "train.activation_checkpointing=false"]).cfg
    assert fused_timesteps(plain) == 1
    assert fused_timesteps(compose_and_validate([*PARITY, "train.activation_checkpointing=true"]).cfg) == 2
    one_sample = [*PARITY, "train.batch_size=1", "train.gradient_accumulation_steps=8"]
    for extra in ([], ["train.mixed_precision=bf16"]):
        cfg = compose_and_validate([*one_sample, *extra]).cfg
        assert fused_timesteps(cfg) == 2 and not activation_checkpointing(cfg)
    cpu = compose_and_validate(["+experiment=smoke", "tpu_topology=cpu"]).cfg
    assert fused_timesteps(cpu) == 1 and not activation_checkpointing(cpu)
    small = compose_and_validate([*PARITY, "parity=none", "model=sd14_topology"]).cfg
    assert fused_timesteps(small) == 10 and not activation_checkpointing(small)
    assert fused_timesteps(compose_and_validate(["+experiment=smoke", "train.timesteps_per_micro_step=4"]).cfg) == 4


def report(v, constraint: str):
    return next(r for r in v.report if r["constraint"] == constraint)["effective"]


def test_auto_fuses_what_fits_the_chip_for_sd3(tmp_path):
    """SD 3.5 Medium has its own figure (~6.5 GiB per transformer evaluation in bf16 on XLA, most of it attention
    softmaxes; ~2.8 checkpointed): on a v6e chip (~15 of 32 GiB left beside the bf16 models and T5-XXL) one sample
    with CFG fits one timestep, and checkpointing would not fuse 3 (the next K dividing the 9 trained timesteps), so
    auto leaves it off; without CFG at train time 3 fuse only checkpointed, so auto turns it on. The tiny SD3 build
    is not held to SD 3.5's memory."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    sd35 = ["+experiment=flow_grpo_pickscore_sd35", f"prompts.path={prompts}"]
    cfg = compose_and_validate(sd35).cfg
    assert fused_timesteps(cfg) == 1 and not activation_checkpointing(cfg)
    cfg = compose_and_validate([*sd35, "parity=none", "train.cfg=false", "sample.guidance_scale=1"]).cfg
    assert fused_timesteps(cfg) == 3 and activation_checkpointing(cfg)
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
    """SD 1.x at 512 px on a v6e chip (32 GiB): 5 timesteps x 2 samples x 2 (CFG) do not fit even with activation
    checkpointing (auto turns it on for an explicit K that does not fit without); the fix names the largest K that
    divides 50 and fits. With one sample per chip 5 fit only checkpointed: refused when it is off, with that fix."""
    found = problems([*PARITY, "train.timesteps_per_micro_step=5"])
    text = found["train.timesteps_per_micro_step"]
    assert "GiB of activations" in text and "(estimate)" in text and "try train.timesteps_per_micro_step=2" in text
    cfg = compose_and_validate([*PARITY, "train.timesteps_per_micro_step=1"]).cfg
    assert not activation_checkpointing(cfg)  # 1 timestep fits without it
    one_sample = [*PARITY, "train.batch_size=1", "train.gradient_accumulation_steps=8"]
    cfg = compose_and_validate([*one_sample, "train.timesteps_per_micro_step=5"]).cfg
    assert activation_checkpointing(cfg) and fused_timesteps(cfg) == 5
    found = problems([*one_sample, "train.timesteps_per_micro_step=5", "train.activation_checkpointing=false"])
    assert "(try train.activation_checkpointing=true (or auto))" in found["train.timesteps_per_micro_step"]
    # the narrow SD 1.4-topology model is not held to SD's memory
    compose_and_validate([*PARITY, "parity=none", "model=sd14_topology", "train.timesteps_per_micro_step=10"])


@pytest.mark.parametrize("bad", ["xla.step_compiler=inductor", "train.timesteps_per_micro_step=0",
                                 "train.activation_checkpointing=sometimes"])
def test_unknown_compiler_and_zero_fusion_are_refused(bad):
    assert bad.split("=")[0] in problems(["+experiment=smoke", bad])


def _micro_step_loss(unet, tables, K: int):
    from ddpo_tpu.algorithms.ddpo import DDPO
    from ddpo_tpu.training.ppo_epoch import make_micro_step_loss
    from ddpo_tpu.families.sd1 import SD1Family

    cfg = compose_and_validate(["+experiment=smoke", "model.lora.enabled=true"]).cfg
    family = SD1Family.__new__(SD1Family)  # the family's score step around this UNet and these tables
    family.cfg, family.model, family.tables = cfg, unet, tables
    return make_micro_step_loss(family.make_score_step(None), DDPO(cfg).loss)


@pytest.fixture
def micro_step_grads(tmp_path):
    """grads(K, checkpointed) -> (loss sum, flat gradient) of one accumulation window of T = 8 timesteps of a batch
    of 2 on the tiny UNet, K timesteps per forward, scaled as the trainer scales it; seeded inputs."""
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

    def grads(K: int, checkpointed: bool = False):
        unet.disable_gradient_checkpointing()
        if checkpointed:
            unet.enable_gradient_checkpointing()
        unet.zero_grad(set_to_none=True)
        fn = _micro_step_loss(unet, tables, K)
        uncond = torch.zeros(B * K, 77, 32)
        total = 0.0
        for j in range(0, T, K):
            loss, kl, clipfrac = fn(cur, nxt, old_lp, idx, (emb,), adv, torch.arange(j, j + K), (uncond,))
            (loss / (T // K)).backward()  # the trainer's scaling with a window of T timesteps
            total += K * float(loss.detach())
        return total, torch.cat([p.grad.flatten() for p in unet.parameters()])

    return grads


def test_fused_micro_steps_give_the_unfused_gradient(micro_step_grads):
    """4 timesteps of a batch of 2 in one forward (batch 8), scaled as the trainer scales it, against 4 separate
    forwards: the same loss sum and the same gradient up to float32 summation order."""
    loss1, g1 = micro_step_grads(1)
    loss4, g4 = micro_step_grads(4)
    assert loss4 == pytest.approx(loss1, rel=1e-6)
    assert float((g4 - g1).abs().max() / g1.abs().max()) < 1e-5
    assert float(g1.abs().max()) > 0


def test_checkpointed_micro_steps_give_the_same_gradient(micro_step_grads):
    """train.activation_checkpointing runs every block again in the backward from its kept input: the same
    computation, so the same loss and gradient (eager CPU is deterministic: equal to float32 rounding)."""
    loss, g = micro_step_grads(2)
    loss_ckpt, g_ckpt = micro_step_grads(2, checkpointed=True)
    assert loss_ckpt == pytest.approx(loss, rel=1e-7)
    assert float((g_ckpt - g).abs().max() / g.abs().max()) < 1e-6
    assert float(g.abs().max()) > 0


def test_one_timestep_a_micro_step_passes_the_conditioning_without_a_copy():
    """At K = 1 the micro-step's inputs are the batch's own conditioning, advantages and weights (repeat_interleave(1)
    copied the text embeddings every micro-step: benchmarks/step_ops.py, docs/performance.md); at K > 1 each row is
    repeated K times, sample-major, as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ddpo_tpu.training.ppo_epoch import _flat_step_inputs, _repeat

    B, T = 3, 4
    cur, nxt = torch.randn(B, T, 2, 2), torch.randn(B, T, 2, 2)
    idx = torch.arange(T).expand(B, T)
    cond = (torch.randn(B, 5, 8), torch.randn(B, 8))
    ops = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Seen():
        _, _, _, c, _ = _flat_step_inputs(cur, nxt, idx, cond, torch.tensor([2]))
    assert all(a is b for a, b in zip(c, cond)) and "aten.clone" not in ops and "aten.repeat_interleave" not in ops
    adv = torch.tensor([1.0, 2.0, 3.0])
    assert _repeat(adv, 1) is adv
    _, _, _, c2, _ = _flat_step_inputs(cur, nxt, idx, cond, torch.tensor([1, 3]))
    assert torch.equal(c2[0], cond[0].repeat_interleave(2, dim=0)) and c2[1].shape == (2 * B, 8)
    assert torch.equal(_repeat(adv, 2), torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0]))
