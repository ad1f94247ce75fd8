"""The catalog: what the project knows about each model family, sampler, reward, algorithm and execution kind, without
torch.

The bottom floor of the package (pydantic and the standard library only): the schema, the rules, the launcher, the
training process and the docs all read these registries, so each fact about a family, reward, algorithm or execution
is written once, in its spec. docs/architecture.md has the checklist for adding one.
"""

from ddpo_tpu.catalog.algorithms import ALGORITHMS, AlgorithmSpec
from ddpo_tpu.catalog.executions import EXECUTIONS, ExecutionSpec, execution
from ddpo_tpu.catalog.families import FAMILIES, FamilyMemory, FamilySpec, family
from ddpo_tpu.catalog.registry import Registry, load_object
from ddpo_tpu.catalog.rewards import REWARDS, TINY, RewardSpec
from ddpo_tpu.catalog.samplers import SAMPLERS, SamplerSpec

__all__ = ["ALGORITHMS", "AlgorithmSpec", "EXECUTIONS", "ExecutionSpec", "FAMILIES", "FamilyMemory", "FamilySpec",
           "REWARDS", "Registry", "RewardSpec", "SAMPLERS", "SamplerSpec", "TINY", "execution", "family", "load_object"]
