"""A model family of the tests' own (tests/unit/project/test_catalog.py registers its spec): SD 1.x-shaped, so the test
is about registering a family, not about a new model. Counts what it encodes, to show the loop went through it."""

from __future__ import annotations

from ddpo_tpu.families.sd1 import SD1Family

NAME = "toy_family_of_a_test"


class ToyFamily(SD1Family):
    name = NAME
    encoded = 0

    def encode(self, prompts):
        type(self).encoded += len(prompts)
        return super().encode(prompts)
