"""Samplers: the `sample.name` values, the keys each one reads (the others must stay unset) and the sampler config
group that picks it with the reference's values (a fix offers it)."""

from __future__ import annotations

from dataclasses import dataclass

from ddpo_tpu.catalog.registry import Registry


@dataclass(frozen=True)
class SamplerSpec:
    name: str
    title: str
    keys: tuple[str, ...]  # the sample.* keys it needs (every sampler key it does not list must stay null)
    group: str             # conf/sampler/<group>.yaml: the reference's settings
    windows: bool = False  # can run the SDE inside a window of its steps and the ODE elsewhere (sample.sde_window)
    # samples a flow-matching model, whose forward process x_t = (1 - t) x0 + t eps DiffusionNFT trains on
    flow: bool = False


SAMPLERS: Registry[SamplerSpec] = Registry("sampler")

SAMPLERS.register(SamplerSpec("ddim", "DDIM with log-probs (DDPO)", keys=("eta",), group="ddim50"))
# ode_solver: the noise-free rollouts' solver (euler; dpm2: DiffusionNFT's DPM-Solver++, algorithms/nft_rollout.py)
SAMPLERS.register(SamplerSpec("flow_sde", "Flow-GRPO's SDE with log-probs",
                              keys=("noise_level", "sde_type", "ode_solver"),
                              group="flow_sde10", windows=True, flow=True))

# flow_grpo's Wan step (wan_pipeline_with_logprob.py): the same SDE mean, a noise scale fixed by the schedule
# (sigma_min + (sigma_max - sigma_min) sigma); no noise_level or sde_type to set; ode_solver as flow_sde's (nft)
SAMPLERS.register(SamplerSpec("wan_sde", "Flow-GRPO's Wan SDE with log-probs", keys=("ode_solver",),
                              group="wan_sde20", windows=True, flow=True))


def sampler_keys() -> tuple[str, ...]:
    """Every sampler-specific key of the sample group."""
    return tuple(dict.fromkeys(k for s in SAMPLERS for k in s.keys))
