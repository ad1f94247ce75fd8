"""Keys that only matter when another key enables them (config/enablement.py): set where nothing reads them, each is
refused in one line naming what would read it; the same key with its enabler composes; defaults never fire."""

from __future__ import annotations

import pytest

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.problems import ConfigError, Fix

CASES = [
    # (overrides, the refused key, words of the reason, the enabling overrides that make it valid)
    (["train.ema_decay=0.5"], "train.ema_decay", "train.ema=false", ["train.ema=true"]),
    (["evaluation.deterministic=true"], "evaluation.deterministic", "every_n_epochs=0", ["evaluation.every_n_epochs=1"]),
    (["logger.project=p"], "logger.project", "logger=none", ["logger=wandb", "logger.mode=offline"]),  # (wandb's)
    (["xla.debug_level=1"], "xla.debug_level", "torch_xla", ["tpu_topology=cpu"]),
    (["tpu_topology.mesh.dp=1"], "tpu_topology.mesh.dp", "one device", ["tpu_topology=cpu_spmd4",
                                                                        "tpu_topology.mesh.dp=4"]),
    (["distributed.compile=none"], "distributed.compile", "not distributed", ["tpu_topology=cpu_dist2"]),
    (["+experiment=flow_grpo_smoke", "stat_tracking.buffer_size=32"], "stat_tracking.buffer_size",
     "algorithm=grpo does not read it", None),
    (["storage_timeout_s=60"], "storage_timeout_s", "output_root is local", ["output_root=gs://bucket/runs"]),
    # AWM (its own clip range, ODE sampling, a weighting's parameter, its KL terms' settings) and GRPO's GARDO reset
    (["+experiment=awm_smoke", "train.clip_range=0.2"], "train.clip_range", "algorithm.clip_range", None),
    (["+experiment=awm_smoke", "sample.noise_level=0.5"], "sample.noise_level", "algorithm=awm sample with the ODE",
     None),
    (["+experiment=awm_smoke", "algorithm.weighting=t", "algorithm.ghuber_power=0.5"], "algorithm.ghuber_power",
     "not ghuber", ["algorithm.weighting=ghuber"]),
    (["+experiment=awm_smoke", "algorithm.ema_beta=0.1"], "algorithm.ema_beta", "kl_beta=0",
     ["algorithm.kl_beta=0.001"]),
    (["+experiment=awm_smoke", "algorithm.kl_ema_decay=0.2"], "algorithm.kl_ema_decay", "no KL term to the slow copy",
     ["algorithm.kl_beta=0.001", "algorithm.ema_beta=0.1"]),
    (["+experiment=flow_grpo_smoke", "algorithm.reference_reset_every=5"], "algorithm.reference_reset_every",
     "never reset", ["algorithm.reference_reset_kl=0.1"]),
]


@pytest.mark.parametrize("overrides,key,reason,enable", CASES, ids=[c[1] for c in CASES])
def test_a_key_nothing_reads_is_refused_and_composes_with_its_enabler(overrides, key, reason, enable):
    with pytest.raises(ConfigError) as e:
        compose_and_validate(overrides)
    found = {p.key: p for p in e.value.problems}
    assert key in found, str(e.value)
    assert reason in found[key].reason and "not read" in found[key].reason
    if enable is not None:  # None: the enabler is another algorithm, whose own rules answer that switch
        compose_and_validate([*overrides, *enable])


def test_the_fix_of_an_ignored_key_is_its_enabler_as_data():
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["train.ema_every=4"])
    (p,) = e.value.problems
    assert isinstance(p.fix, Fix) and p.suggested() == ["train.ema=true"]


def test_an_ema_that_would_never_update_is_refused():
    # smoke: 2 optimizer steps an epoch x 20 epochs = 40 steps
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", "train.ema=true", "train.ema_every=41"])
    assert "never be updated" in str(e.value)
    compose_and_validate(["+experiment=smoke", "train.ema=true", "train.ema_every=40"])


def test_every_shipped_experiment_composes_without_its_defaults_firing():
    # the groups carry keys for every run (xla.*, evaluation.*, logger.*): they are never judged, only what is set
    for experiment in ("smoke", "flow_grpo_smoke", "digits"):
        compose_and_validate([f"+experiment={experiment}"])
