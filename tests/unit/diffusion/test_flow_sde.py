"""Tests for the Flow-GRPO step with log-probability (ddpo_tpu.diffusion.flow)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from ddpo_tpu.diffusion.flow import FlowTables, sde_step_with_logprob

REPO = Path(__file__).resolve().parents[3]
SHAPE = (6, 16, 4, 4)
NOISE_LEVEL = {"sde": 0.7, "cps": 0.8}  # flow_grpo's defaults for each type


def sd35_scheduler(num_steps: int | None = None) -> FlowMatchEulerDiscreteScheduler:
    """SD 3.5 Medium's scheduler config: 1000 train timesteps, static shift 3.0."""
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    if num_steps is not None:
        sched.set_timesteps(num_steps)
    return sched


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def transcribed_step(sched, model_output, timesteps, sample, noise_level, sde_type, prev_sample=None, noise=None):
    """The formula of the Flow-GRPO paper / flow_grpo's step written out sample by sample with Python-float sigmas
    (float32 tensors, as the reference computes). Returns (prev, log_prob, mean, std) per the reference convention."""
    ts = [float(t) for t in sched.timesteps]
    sig = [float(s) for s in sched.sigmas]
    prevs, logps, means, stds = [], [], [], []
    for b in range(sample.shape[0]):
        i = ts.index(float(timesteps[b]))
        s, s_next = sig[i], sig[i + 1]
        x, v = sample[b].float(), model_output[b].float()
        if sde_type == "sde":
            denom_sigma = sig[1] if s == 1.0 else s
            std = noise_level * math.sqrt(s / (1.0 - denom_sigma))
            dt = s_next - s
            mean = x * (1.0 + std**2 * dt / (2.0 * s)) + v * dt * (1.0 + std**2 * (1.0 - s) / (2.0 * s))
            scale = std * math.sqrt(-dt)
            prev = prev_sample[b].float() if prev_sample is not None else mean + scale * noise[b]
            logp = (-((prev - mean) ** 2) / (2.0 * scale**2) - math.log(scale) - 0.5 * math.log(2.0 * math.pi)).mean()
        else:
            std = s_next * math.sin(noise_level * math.pi / 2.0)
            x0_hat = x - s * v
            x1_hat = x + (1.0 - s) * v
            mean = (1.0 - s_next) * x0_hat + math.sqrt(max(s_next**2 - std**2, 0.0)) * x1_hat
            prev = prev_sample[b].float() if prev_sample is not None else mean + std * noise[b]
            logp = (-((prev - mean) ** 2)).mean()
        prevs.append(prev)
        logps.append(logp)
        means.append(mean)
        stds.append(std)
    return torch.stack(prevs), torch.stack(logps), torch.stack(means), torch.tensor(stds)


def close(actual, expected, rtol=1e-6, atol=1e-6):
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=atol)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("num_steps", [10, 40])
def test_step_matches_the_formula_transcription(sde_type, num_steps):
    sched = sd35_scheduler(num_steps)
    nl = NOISE_LEVEL[sde_type]
    for seed in range(3):
        idx = torch.randint(0, num_steps, (SHAPE[0],), generator=torch.Generator().manual_seed(seed))
        idx[0] = 0  # the sigma == 1 step
        idx[1] = num_steps - 1  # the step to sigma = 0
        ts = sched.timesteps[idx]
        v, x = randn(*SHAPE, seed=10 + seed), randn(*SHAPE, seed=20 + seed)

        # drawing: the noise is randn_tensor(shape, generator) as in the reference
        prev, logp, mean, std = sde_step_with_logprob(sched, v, ts, x, noise_level=nl, sde_type=sde_type,
                                                      generator=torch.Generator().manual_seed(99))
        z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(99))
        e_prev, e_logp, e_mean, e_std = transcribed_step(sched, v, ts, x, nl, sde_type, noise=z)
        close(mean, e_mean)
        close(prev, e_prev)
        close(std.reshape(-1), e_std)
        assert std.shape == (SHAPE[0], 1, 1, 1)
        assert prev.dtype == logp.dtype == mean.dtype == torch.float32 and logp.shape == (SHAPE[0],)
        finite = (e_std > 0) if sde_type == "cps" else torch.ones(SHAPE[0], dtype=torch.bool)
        # (sde: the log-prob of a drawn sample depends on (prev - mean) / scale, rounded in float32 each way)
        close(logp[finite], e_logp[finite], rtol=1e-5 if sde_type == "sde" else 1e-6)

        # scoring a given prev_sample (training time)
        other = prev + 0.05 * randn(*SHAPE, seed=30 + seed)
        _, logp2, mean2, _ = sde_step_with_logprob(sched, v, ts, x, noise_level=nl, prev_sample=other,
                                                   sde_type=sde_type)
        _, e_logp2, e_mean2, _ = transcribed_step(sched, v, ts, x, nl, sde_type, prev_sample=other)
        close(mean2, e_mean2)
        if sde_type == "sde":
            close(logp2, e_logp2)
        else:
            close(logp2[finite], e_logp2[finite])


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_tables_step_equals_the_reference_entry_point_bit_for_bit(sde_type):
    num_steps = 10
    sched = sd35_scheduler(num_steps)
    tables = FlowTables.from_scheduler(sd35_scheduler(), num_steps, "cpu")
    nl = NOISE_LEVEL[sde_type]
    idx = torch.tensor([0, 3, 9, 5, 1, 0])
    v, x = randn(*SHAPE, seed=1), randn(*SHAPE, seed=2)
    for dtype in (torch.float32, torch.bfloat16):
        ref = sde_step_with_logprob(sched, v.to(dtype), sched.timesteps[idx], x.to(dtype), noise_level=nl,
                                    sde_type=sde_type, generator=torch.Generator().manual_seed(5))
        z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
        got = tables.step(v.to(dtype), idx, x.to(dtype), nl, sde_type=sde_type, noise=z)
        for a, b in zip(ref, got):
            assert a.dtype == b.dtype and torch.equal(a, b)
        # training-time rescoring of the drawn sample
        ref2 = sde_step_with_logprob(sched, v, sched.timesteps[idx], x, noise_level=nl, sde_type=sde_type,
                                     prev_sample=ref[0])
        got2 = tables.step(v, idx, x, nl, sde_type=sde_type, prev_sample=ref[0], noise=z + 1.0)  # noise ignored
        for a, b in zip(ref2, got2):
            assert torch.equal(a, b)
    # a 0-d index broadcasts like the reference's (1,) timestep (the pipeline passes t.unsqueeze(0))
    ref3 = sde_step_with_logprob(sched, v, sched.timesteps[4].unsqueeze(0), x, noise_level=nl, sde_type=sde_type,
                                 generator=torch.Generator().manual_seed(6))
    got3 = tables.step(v, torch.tensor(4), x, nl, sde_type=sde_type,
                       noise=torch.randn(SHAPE, generator=torch.Generator().manual_seed(6)))
    for a, b in zip(ref3, got3):
        assert a.shape == b.shape and torch.equal(a, b)


def test_timesteps_and_sigmas_are_what_the_sd3_pipeline_uses():
    tables = FlowTables.from_scheduler(sd35_scheduler(), 10, "cpu")
    sched = sd35_scheduler(10)  # StableDiffusion3Pipeline: retrieve_timesteps -> set_timesteps(10), no mu
    idx = torch.arange(10)
    assert torch.equal(tables.timestep_at(idx), sched.timesteps)  # the pipeline calls transformer(t.expand(B))
    assert tables.timestep_at(idx).dtype == torch.float32
    assert torch.equal(tables.sigmas, sched.sigmas)
    # shift 3: sigma = 3 s / (1 + 2 s) over s = linspace(1, sigma_min, 10), then a final 0 (diffusers' sigma_min is
    # the shifted sigma of the last train timestep, 3e-3 / 1.002, so the last step is shifted twice)
    sigma_min = 3 * 1e-3 / (1 + 2 * 1e-3)
    s = torch.linspace(1.0, sigma_min, 10, dtype=torch.float64)
    torch.testing.assert_close(tables.sigmas[:-1].double(), 3 * s / (1 + 2 * s), rtol=1e-6, atol=0)
    assert tables.sigmas[0] == 1.0 and tables.sigmas[-1] == 0.0
    torch.testing.assert_close(tables.timestep_at(idx), tables.sigmas[:-1] * 1000)
    with pytest.raises(ValueError, match="mu"):
        FlowTables.from_scheduler(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), 10, "cpu")


def test_log_prob_is_the_gaussian_log_density_at_the_drawn_sample():
    num_steps = 10
    tables = FlowTables.from_scheduler(sd35_scheduler(), num_steps, "cpu")
    idx = torch.tensor([0, 1, 4, 7, 8, 9])
    v, x, z = randn(*SHAPE, seed=3), randn(*SHAPE, seed=4), randn(*SHAPE, seed=5)
    prev, logp, mean, std = tables.step(v, idx, x, 0.7, sde_type="sde", noise=z)
    sigma, sigma_next = tables.sigmas_at(idx)
    scale = std * torch.sqrt(sigma - sigma_next).reshape(-1, 1, 1, 1)
    expected = torch.distributions.Normal(mean.double(), scale.double()).log_prob(prev.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(logp.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prev, mean + scale * z)

    # CPS: x' = mean + std z and, with every constant dropped, log_prob = -mean((x' - mean)^2) = -std^2 mean(z^2)
    prev_c, logp_c, mean_c, std_c = tables.step(v, idx, x, 0.8, sde_type="cps", noise=z)
    torch.testing.assert_close(std_c.reshape(-1), sigma_next * math.sin(0.8 * math.pi / 2))
    torch.testing.assert_close(prev_c, mean_c + std_c * z)
    torch.testing.assert_close(logp_c, -(std_c.reshape(-1) ** 2) * (z**2).mean(dim=(1, 2, 3)), rtol=1e-4, atol=1e-7)
    assert logp_c[-1] == 0.0  # the last step (sigma' = 0) is deterministic


def test_sigma_one_is_replaced_by_the_second_sigma_in_the_denominator_only():
    tables = FlowTables.from_scheduler(sd35_scheduler(), 10, "cpu")
    s1 = float(tables.sigmas[1])
    assert float(tables.sigmas[0]) == 1.0 and s1 < 1.0
    v, x = randn(1, 16, 4, 4, seed=6), randn(1, 16, 4, 4, seed=7)
    z = randn(1, 16, 4, 4, seed=8)
    _, logp0, mean0, std0 = tables.step(v, torch.tensor([0]), x, 0.7, noise=z)
    _, _, _, std1 = tables.step(v, torch.tensor([1]), x, 0.7, noise=z)
    # sqrt(1 / (1 - sigmas[1])): numerator 1, denominator sigma replaced (sqrt(1 / (1 - 1)) would be inf)
    assert float(std0) == pytest.approx(0.7 * math.sqrt(1.0 / (1.0 - s1)), rel=1e-6)
    assert float(std1) == pytest.approx(0.7 * math.sqrt(s1 / (1.0 - s1)), rel=1e-6)
    assert float(std0) != pytest.approx(float(std1), rel=1e-3)
    assert torch.isfinite(logp0).all() and torch.isfinite(mean0).all()


def test_ode_step_is_the_euler_step_of_the_scheduler():
    num_steps = 10
    tables = FlowTables.from_scheduler(sd35_scheduler(), num_steps, "cpu")
    sched = sd35_scheduler(num_steps)
    x = randn(2, 16, 4, 4, seed=9)
    for i, t in enumerate(sched.timesteps):
        v = randn(2, 16, 4, 4, seed=100 + i)
        expected = sched.step(v, t, x, return_dict=False)[0]  # diffusers' FlowMatchEulerDiscreteScheduler.step
        got = tables.ode_step(v, torch.tensor([i, i]), x)
        assert torch.equal(got, expected)
        # the reference evaluates with noise_level=0 through the SDE step: the same mean
        _, _, mean0, _ = tables.step(v, torch.tensor([i, i]), x, 0.0, noise=torch.zeros_like(x))
        assert torch.equal(mean0, got)
        x = got
    assert sched.step_index == num_steps


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_gradient_reaches_model_output_through_the_mean_only(sde_type):
    tables = FlowTables.from_scheduler(sd35_scheduler(), 10, "cpu")
    idx = torch.tensor([0, 2, 5, 7, 8, 3])
    v = randn(*SHAPE, seed=11).requires_grad_(True)
    x = randn(*SHAPE, seed=12)
    target = (randn(*SHAPE, seed=13) * 0.1 + x).requires_grad_(True)
    nl = NOISE_LEVEL[sde_type]
    _, logp, mean, std = tables.step(v, idx, x, nl, sde_type=sde_type, prev_sample=target)
    grad_v, grad_target = torch.autograd.grad(logp.sum(), (v, target), allow_unused=True)
    assert grad_target is None  # prev_sample is detached before the log-prob

    # analytic: d log_prob_b / d v = mean over elements of (d log p / d mean) * (d mean / d v)
    sigma, sigma_next = (s.reshape(-1, 1, 1, 1) for s in tables.sigmas_at(idx))
    n = x[0].numel()
    m, tgt = mean.detach(), target.detach()
    if sde_type == "sde":
        dt = sigma_next - sigma
        dmean_dv = (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        dlogp_dmean = (tgt - m) / (std**2 * -dt)
    else:
        dmean_dv = -sigma * (1 - sigma_next) + (1 - sigma) * torch.sqrt(sigma_next**2 - std**2)
        dlogp_dmean = 2 * (tgt - m)
    torch.testing.assert_close(grad_v, dlogp_dmean * dmean_dv / n, rtol=1e-4, atol=1e-8)

    # a drawn sample: the log-prob sees it detached, so the gradient is that of a fixed point mean + scale z
    v2 = v.detach().clone().requires_grad_(True)
    prev, logp2, mean2, _ = tables.step(v2, idx, x, nl, sde_type=sde_type, noise=randn(*SHAPE, seed=14))
    assert prev.requires_grad  # the sample itself carries the mean's graph (as in the reference) ...
    (g2,) = torch.autograd.grad(logp2.sum(), v2)
    v3 = v.detach().clone().requires_grad_(True)
    _, logp3, _, _ = tables.step(v3, idx, x, nl, sde_type=sde_type, prev_sample=prev.detach())
    (g3,) = torch.autograd.grad(logp3.sum(), v3)
    assert torch.equal(g2, g3)  # ... but the log-prob's gradient does not flow through it


def test_bad_arguments():
    sched = sd35_scheduler(10)
    v, x = randn(*SHAPE, seed=1), randn(*SHAPE, seed=2)
    ts = sched.timesteps[:SHAPE[0]]
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(sched, v, ts, x, sde_type="ode")
    with pytest.raises(ValueError, match="generator and prev_sample"):
        sde_step_with_logprob(sched, v, ts, x, prev_sample=x, generator=torch.Generator())
    with pytest.raises(ValueError, match="set_timesteps"):
        sde_step_with_logprob(sd35_scheduler(), v, ts, x)
    tables = FlowTables.from_scheduler(sd35_scheduler(), 10, "cpu")
    with pytest.raises(ValueError, match="prev_sample or noise"):
        tables.step(v, torch.zeros(SHAPE[0], dtype=torch.long), x, 0.7)
    with pytest.raises(ValueError, match="step_index"):
        tables.step(v, torch.zeros(3, dtype=torch.long), x, 0.7, noise=x)


XLA_PROBE = """
import torch, torch_xla, torch_xla.core.xla_model as xm, torch_xla.debug.metrics as met
from diffusers import FlowMatchEulerDiscreteScheduler
from ddpo_tpu.diffusion.flow import FlowTables
dev = torch_xla.device()
tables = FlowTables.from_scheduler(FlowMatchEulerDiscreteScheduler(shift=3.0), 8, dev)
x = torch.randn(4, 16, 4, 4).to(dev)
counts = []
for i in range(8):
    idx = torch.full((4,), i, dtype=torch.long).to(dev)
    v = torch.randn(4, 16, 4, 4).to(dev)
    z = torch.randn(4, 16, 4, 4).to(dev)
    x, logp, mean, std = tables.step(v, idx, x, 0.7, sde_type="sde", noise=z)
    t = tables.timestep_at(idx)
    xm.mark_step()
    counts.append(met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0)
print("COUNTS", counts, "TRANSFERS", met.metric_data("TransferFromDeviceTime"), flush=True)
"""


@pytest.mark.slow
@pytest.mark.xla
def test_tables_step_compiles_once_on_xla():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "TPU_"))}
    env["PJRT_DEVICE"] = "CPU"
    res = subprocess.run([sys.executable, "-c", XLA_PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("COUNTS"))
    counts = eval(line.split("COUNTS", 1)[1].split("TRANSFERS")[0])
    transfers = line.split("TRANSFERS", 1)[1].strip()
    assert counts[0] >= 1 and counts[-1] == counts[0], counts  # step 0 compiles; steps 1..7 replay it
    assert transfers == "None", transfers  # nothing read back to the host
