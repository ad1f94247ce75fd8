"""GARDO's adaptive KL reference as `algorithm.reference_reset_kl` of GRPO, against yifan123/flow_grpo at
94e23ee5405ab7241fc1f75d30cac8147e2b1f53, scripts/train_sd3_gardo.py (line numbers of that commit's text as the
store serves it): the KL's reference is an "old" copy of the policy (:462-468, 636-640), not the adapter-off base
model, reset to the current weights after sampling (:787-797) when the previous epoch's KL passed kl_thres (:1041) or
reset_freq epochs went by. Off by default: flow_grpo's train_sd3.py (the parity runs) compares with the adapter-off
model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddpo_tpu.config.compose import ConfigError, compose_and_validate
from ddpo_tpu.algorithms.guards import AdaptiveReference

SMOKE = ["+experiment=flow_grpo_smoke"]


def reference_resets(kls_per_epoch, thres, reset_freq):
    """The reference's control flow: `reset=False; prev_epoch=0`; after each epoch's sampling `if config.train.beta>0:
    if (epoch !=0 and reset==True) or (epoch - prev_epoch)>config.reset_freq:` copy, `reset = False`, `prev_epoch =
    epoch`; after each optimizer step `if info["kl_loss"] > thres: reset=True`."""
    reset, prev_epoch, resets = False, 0, []
    for epoch, kls in enumerate(kls_per_epoch):
        if (epoch != 0 and reset) or (epoch - prev_epoch) > reset_freq:
            resets.append(epoch)
            reset = False
            prev_epoch = epoch
        for kl in kls:
            if kl > thres:
                reset = True
    return resets


@pytest.mark.parametrize("seed", range(4))
def test_reset_schedule_equals_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    kls = [(torch.rand(2, generator=g) * 4e-4 * (1 + (e % 5 == 0))).tolist() for e in range(40)]
    ours = AdaptiveReference(3e-4, 15)
    got = []
    for epoch, steps in enumerate(kls):
        if ours.due(epoch):
            got.append(epoch)
        ours.observe([{"kl": k} for k in steps])
    assert got == reference_resets(kls, 3e-4, 15)
    # quiet KLs: only the reset_freq rule, first at epoch 16 (16 - 0 > 15), then 32
    quiet = AdaptiveReference(3e-4, 15)
    assert [e for e in range(40) if quiet.due(e)] == reference_resets([[0.0]] * 40, 3e-4, 15) == [16, 32]


def test_the_kl_reference_is_the_reset_copy_not_the_adapter_off_model(tmp_path, model_cache):
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate([*SMOKE, f"model.cache_dir={model_cache}", "algorithm.reference_reset_kl=3e-4"])
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    params = tr.state.params
    start = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(0.01)  # as if trained
    moved = [p.detach().clone() for p in params]
    with tr.epoch_trainer.reference_policy():  # the loop's KL reference: the copy made at the start (the old adapter)
        assert all(torch.equal(p, s) for p, s in zip(params, start))
    assert all(torch.equal(p, m) for p, m in zip(params, moved))
    adaptive = tr.algorithm.adaptive
    adaptive.observe([{"kl": 1e-3}])  # an update over kl_thres flags a reset
    assert adaptive.due(1) and not adaptive.due(2)
    with tr.epoch_trainer.reference_policy():  # reset after sampling: the copy is the current policy
        assert all(torch.equal(p, m) for p, m in zip(params, moved))
    assert tr.algorithm.state_dict() == {"gardo_flagged": False, "gardo_last_reset": 1}


def test_off_by_default_the_reference_is_the_adapter_off_model(tmp_path, model_cache):
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate([*SMOKE, f"model.cache_dir={model_cache}"])
    assert v.cfg.algorithm.reference_reset_kl is None
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    assert tr.algorithm.adaptive is None and "gardo_reference" not in tr.state.copies
    assert tr.epoch_trainer.reference_policy == tr.family.reference and tr.algorithm.state_dict() == {}


def test_a_reset_reference_needs_a_kl_term():
    with pytest.raises(ConfigError) as e:
        compose_and_validate([*SMOKE, "algorithm.kl_beta=0", "algorithm.reference_reset_kl=3e-4"])
    assert any(p.key == "algorithm.reference_reset_kl" for p in e.value.problems)
