"""Keys that moved keep working: xla.shuffle_timesteps is algorithm.shuffle_timesteps (DDPO's) now. An old command
line, a config saved by an earlier version and the config stored in an earlier checkpoint are read under the new
name, so old runs resume and old sweeps compose."""

from __future__ import annotations

import copy

from ddpo_tpu.config.compose import compose_and_validate, validate_tree
from ddpo_tpu.config.resume import changed_keys, resume_relevant
import pytest

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)


def test_the_old_override_sets_the_new_key():
    assert compose_and_validate(["xla.shuffle_timesteps=false"]).cfg.algorithm.shuffle_timesteps is False
    assert compose_and_validate([]).cfg.algorithm.shuffle_timesteps is True


def test_a_config_saved_before_the_move_validates_and_keeps_its_value():
    tree = copy.deepcopy(compose_and_validate([]).tree)
    del tree["algorithm"]["shuffle_timesteps"]
    tree["xla"]["shuffle_timesteps"] = False  # as an earlier version saved it
    v = validate_tree(tree)
    assert v.cfg.algorithm.shuffle_timesteps is False and "shuffle_timesteps" not in v.tree["xla"]


def test_a_checkpoint_of_an_earlier_version_compares_under_the_new_name():
    now = resume_relevant(compose_and_validate([]).tree)
    old_tree = copy.deepcopy(compose_and_validate([]).tree)
    del old_tree["algorithm"]["shuffle_timesteps"]
    old_tree["xla"]["shuffle_timesteps"] = True
    then = resume_relevant(old_tree)
    assert then["algorithm.shuffle_timesteps"] is True and changed_keys(then, now) == []
    old_tree["xla"]["shuffle_timesteps"] = False  # trained without the shuffle: a resume with it is refused by name
    assert changed_keys(resume_relevant(old_tree), now) == ["algorithm.shuffle_timesteps"]
    # a checkpoint stores the flat keys: read again, they map the same way
    assert changed_keys(resume_relevant(resume_relevant(old_tree)), now) == ["algorithm.shuffle_timesteps"]
