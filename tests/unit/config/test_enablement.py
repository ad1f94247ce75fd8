"""Keys that only matter when another key enables them (config/enablement.py): set where nothing reads them, each is
refused in one line naming what would read it; the same key with its enabler composes; defaults never fire."""

from __future__ import annotations

import pytest

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.problems import ConfigError, Fix

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

CASES = [
    # (overrides, the refused key, words of the reason, the enabling overrides that make it valid)
    (["train.ema_decay=0.5"], "train.ema_decay", "train.ema=false", ["train.ema=true"]),
    (["evaluation.deterministic=true"], "evaluation.deterministic", "every_n_epochs=0",
     ["evaluation.every_n_epochs=1"]),
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


# --- every catalog key of each smoke experiment: read by its run, or refused when set (issue 43) ----------------------

# each smoke experiment, two epochs and fewer batches (its own keys otherwise); not digits, which first trains its own
# model for minutes (its algorithm and sampler are smoke's: DDPO with DDIM)
SMOKES = {
    "smoke": [], "gardo_smoke": [],
    "flow_grpo_smoke": ["sample.num_batches_per_epoch=2", "train.gradient_accumulation_steps=1"],
    "nft_smoke": ["sample.num_batches_per_epoch=2"], "awm_smoke": ["sample.num_batches_per_epoch=2"],
    "flux_grpo_smoke": ["sample.num_batches_per_epoch=2", "train.gradient_accumulation_steps=1"],
    "qwen_image_grpo_smoke": ["sample.num_batches_per_epoch=2", "train.gradient_accumulation_steps=1"],
    "wan_grpo_smoke": ["sample.num_batches_per_epoch=2", "train.gradient_accumulation_steps=1"],
}


def _recorded_reads(models) -> tuple[dict[int, set[str]], object]:
    """Record which fields of these pydantic models the code reads (an attribute read, or a model_dump that hands
    them on, as rewards/from_config.py builds a reward from its keys); returns (reads by id(model), undo)."""
    reads: dict[int, set[str]] = {}
    saved = {}
    for cls in {type(m) for m in models}:
        get, dump = cls.__getattribute__, cls.model_dump
        saved[cls] = (get, dump)

        def getattribute(self, name, _get=get, _fields=frozenset(cls.model_fields)):
            if name in _fields:
                reads.setdefault(id(self), set()).add(name)
            return _get(self, name)

        def model_dump(self, *a, _dump=dump, **kw):
            out = _dump(self, *a, **kw)
            reads.setdefault(id(self), set()).update(k for k in out if k in type(self).model_fields)
            return out

        cls.__getattribute__, cls.model_dump = getattribute, model_dump

    def undo():
        for c, (get, dump) in saved.items():
            c.__getattribute__, c.model_dump = get, dump
    return reads, undo


def _catalog_keys(cfg) -> dict[str, object]:
    """The dotted keys of the run's catalog entries with their values: its algorithm's and its reward's keys (catalog
    AlgorithmSpec.keys, RewardSpec.keys) and every sampler's keys under sample. (catalog SamplerSpec.keys)."""
    from ddpo_tpu.catalog.samplers import sampler_keys

    out = {f"algorithm.{k}": getattr(cfg.algorithm, k) for k in type(cfg.algorithm).model_fields if k != "name"}
    out |= {f"reward.{k}": getattr(cfg.reward, k) for k in type(cfg.reward).model_fields if k != "name"}
    out |= {f"sample.{k}": getattr(cfg.sample, k) for k in sampler_keys()}
    return out


def _other_values(model, field: str, value) -> list[str]:
    """Values other than `value` the field's own schema accepts (its type and bounds), as override text."""
    from types import UnionType
    from typing import Literal, Union, get_args, get_origin

    from pydantic import ValidationError

    from ddpo_tpu.problems import as_typed

    def valid(v) -> bool:
        try:
            type(model).model_validate({**model.model_dump(), field: v})
        except ValidationError:
            return False
        return True

    ann = type(model).model_fields[field].annotation
    union = get_origin(ann) in (Union, UnionType)
    args = [a for a in get_args(ann) if a is not type(None)] if union else [ann]
    out: list = []
    for a in args:
        if get_origin(a) is Literal:
            out += [v for v in get_args(a) if v != value]
        elif a is bool:
            out += [not value] if isinstance(value, bool) else [True, False]
        elif a is int:
            out += [value + 1, value - 1] if isinstance(value, int) else [1, 2]
        elif a is float:
            out += [value * 2, value / 2, value + 0.1] if isinstance(value, float) and value else [0.5, 0.1, 1.5]
        elif a is str:
            out += ["elsewhere"]
    return [as_typed(v) for v in out if v != value and valid(v)]


@pytest.mark.needs_torch
@pytest.mark.slow
def test_every_catalog_key_of_each_smoke_experiment_is_read_or_refused(tmp_path, model_cache):
    """Issue 43's last "done when": each smoke experiment runs two epochs in this process while the reads of its
    algorithm's, reward's and sampler's keys are recorded; every key its run never read is refused when set to
    another value, except a feature's switch at its off value (None, [], false), which another smoke experiment
    that turns the feature on must read."""
    from types import SimpleNamespace

    import torch

    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop

    torch.set_num_threads(1)
    unread: dict[str, dict[str, object]] = {}
    read_somewhere: set[str] = set()
    for name, shrink in SMOKES.items():
        v = compose_and_validate([f"+experiment={name}", f"model.cache_dir={model_cache}", "num_epochs=2", *shrink])
        cfg = v.cfg
        (tmp_path / name).mkdir()
        reads, undo = _recorded_reads([cfg.algorithm, cfg.reward, cfg.sample])
        try:
            loop.Trainer(cfg, make_runtime(cfg), RunDir(tmp_path / name), tree=v.tree,
                         stop=SimpleNamespace(requested=False)).fit()
        finally:
            undo()
        seen = {f"{section}.{k}" for section, m in (("algorithm", cfg.algorithm), ("reward", cfg.reward),
                                                    ("sample", cfg.sample)) for k in reads.get(id(m), ())}
        read_somewhere |= {f"{cfg.algorithm.name}:{k}" for k in seen}
        unread[name] = {k: val for k, val in _catalog_keys(cfg).items() if k not in seen}
        print(name, "unread:", sorted(unread[name]))
    silent = []
    for name, keys in unread.items():
        cfg = compose_and_validate([f"+experiment={name}"]).cfg
        for key, value in keys.items():
            section, field = key.split(".", 1)
            model = getattr(cfg, section)
            if value in (None, [], False) and f"{cfg.algorithm.name}:{key}" in read_somewhere:
                continue  # a switch at off: read where another smoke experiment turns it on
            others = _other_values(model, field, value)
            assert others, f"{name}: {key}: no other value to try"
            for typed in others:
                try:
                    compose_and_validate([f"+experiment={name}", f"{key}={typed}"])
                except ConfigError:
                    continue  # refused before anything starts (a valid value of the key: its combination is)
                silent.append(f"{name}: {key}={typed}")
    assert not silent, f"set where the run never reads them, yet not refused: {silent}"
