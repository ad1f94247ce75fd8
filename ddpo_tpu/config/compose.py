"""Compose a config with Hydra's compose API and validate it: schema (schema.py), then rules (rules.py).

Used by the front end before anything starts (every sweep point), by the training process, and by tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Iterable, Mapping, Union, cast, get_args, get_origin

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from ddpo_tpu.rundir import storage_url
from ddpo_tpu.catalog.algorithms import ALGORITHMS, owner_of
from ddpo_tpu.config import rules
from ddpo_tpu.config.batch import MISSING, lookup
from ddpo_tpu.config.plan import RunPlan, run_plan
from ddpo_tpu.config.resume import MOVED_KEYS
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.config.topology import conf_dir  # noqa: F401 -- also the front end's (train.py) and the tests'
from ddpo_tpu.problems import ConfigError, Fix, Problem

# hydra.run.dir / hydra.sweep.dir (conf/config.yaml): a local output_root as it is, a gs:// one's local staging dir
OmegaConf.register_new_resolver("ddpo_local_root", storage_url.local_root, replace=True)


@dataclass(frozen=True)
class Validated:
    cfg: RunConfig                  # typed, frozen
    tree: dict[str, Any]            # the same config as plain containers (what gets saved)
    report: list[dict[str, Any]]    # the parity report rows
    # the run's decisions (config/plan.py), made here once; computed from `cfg` when not given
    plan: RunPlan | None = None

    def __post_init__(self) -> None:
        if self.plan is None:
            object.__setattr__(self, "plan", run_plan(self.cfg))


def overridden_keys(overrides: Iterable[str]) -> frozenset[str]:
    return frozenset(o.split("=", 1)[0].lstrip("+~") for o in moved(overrides))


def moved(overrides: Iterable[str]) -> list[str]:
    """Overrides of keys that moved (MOVED_KEYS) under their new names: old command lines keep working."""
    out = []
    for o in overrides:
        head, eq, value = o.partition("=")
        key = head.lstrip("+~")
        out.append(f"{head[:len(head) - len(key)]}{MOVED_KEYS[key]}{eq}{value}" if key in MOVED_KEYS else o)
    return out


def migrate(tree: dict[str, Any]) -> dict[str, Any]:
    """A config tree saved by an earlier version with its moved keys under their new names (in place)."""
    for old, new in MOVED_KEYS.items():
        section, _, name = old.partition(".")
        if isinstance(tree.get(section), dict) and name in tree[section]:
            value = tree[section].pop(name)
            new_section, _, new_name = new.partition(".")
            target = tree.get(new_section)
            if isinstance(target, dict) and new_name in owner_keys(target.get("name")):
                target.setdefault(new_name, value)
    return tree


def owner_keys(algorithm: Any) -> set[str]:
    """The keys of a registered algorithm (none for an unknown name: the schema names that problem)."""
    return set(ALGORITHMS.get(algorithm).keys.model_fields) if algorithm in ALGORITHMS else set()


def compose(overrides: list[str]) -> DictConfig:
    """Compose conf/config.yaml with command-line style overrides. Raises ConfigError on composition errors."""
    overrides = moved(overrides)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=False)
    except Exception as e:  # hydra and omegaconf raise several types; each becomes one problem line
        raise ConfigError([_compose_problem(e, overrides)]) from e
    finally:
        GlobalHydra.instance().clear()


def _compose_problem(e: Exception, overrides: list[str]) -> Problem:
    from hydra.errors import OverrideParseException

    msg = str(e).strip()
    first = msg.splitlines()[0] if msg else type(e).__name__
    if isinstance(e, OverrideParseException):
        return grammar_problem(e)
    m = (re.search(r"full_key: (\S+)", msg) or re.search(r"override '([^']+)'", msg)
         or re.search(r"Multiple values for ([\w.]+)\.", msg))
    key = m.group(1) if m else "overrides"
    value = next((o.split("=", 1)[1] for o in overrides if "=" in o and o.split("=", 1)[0].lstrip("+~") == key), "")
    m = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", msg)
    if m:  # seed=1,2 without -m: Hydra's sweep syntax outside a sweep
        return Problem(m.group(1), m.group(2), "a comma list is a sweep",
                       f"add -m to run one job per value, or quote a list: '{m.group(1)}=[{m.group(2)}]'")
    if "not in struct" in msg or "Could not override" in msg:
        return (_foreign_algorithm_key(key, value) or _foreign_model_key(key, value) or _slip(key, value, overrides)
                or Problem(key, value, "unknown key", "check the spelling; --cfg job lists every key"))
    m = re.search(r"Could not find '([^']+)'", msg)
    if m:
        group = m.group(1).split("/")[0]
        halves = re.split(r"Available options(?: in '[^']*')?:", msg, maxsplit=1)
        listed = halves[1].split("Config search path", 1)[0] if len(halves) > 1 else ""
        options = re.findall(r"^\s+(\S+)\s*$", listed, flags=re.M)
        value = next((o.split("=", 1)[1] for o in overrides
                      if "=" in o and o.split("=", 1)[0].lstrip("+~") == group), m.group(1))
        return Problem(group, value, "no such option",
                       f"choose one of: {', '.join(options)}" if options else "see --help for the options")
    return Problem(key, value, first.rstrip(".:"), "see --help for the syntax")


def _slip(key: str, value: Any, overrides: list[str]) -> Problem | None:
    """The two usual slips: a group that the defaults list does not hold, selected without its `+`
    (experiment=smoke), and a near miss of a real key (sample.batch_sise), answered with the key it resembles."""
    import difflib

    if "." not in key and (conf_dir() / key).is_dir():
        return Problem(key, value, f"the {key} group is added to the defaults, not overridden",
                       f"use +{key}={value}")
    parent, _, name = key.rpartition(".")
    others = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        tree = _plain(compose(others), resolve=False)
    except ConfigError:
        return None
    keys = lookup(tree, parent) if parent else tree
    if not isinstance(keys, dict):
        return None
    near = difflib.get_close_matches(name, [str(k) for k in keys], n=1, cutoff=0.75)
    if not near:
        return None
    return Problem(key, value, "unknown key", f"did you mean {parent + '.' if parent else ''}{near[0]}?")


def _foreign_algorithm_key(key: str, value: Any) -> Problem | None:
    """A key of another algorithm than the run's (algorithm.group_size under algorithm=ddpo)."""
    owner = owner_of(key) if key.startswith("algorithm.") else None
    if owner is None:
        return None
    return Problem(key, value, f"a {owner.title} setting; the run's algorithm does not read it",
                   Fix.of({"algorithm": owner.name}, verb="add"))


def _foreign_model_key(key: str, value: Any) -> Problem | None:
    """A key the run's config lacks because another sampler or model family has it (sample.sde_window under DDIM,
    model.text_encoder_3 under FLUX): named with who has it, not as a misspelling."""
    from ddpo_tpu.catalog import FAMILIES, SAMPLERS

    section, _, rest = key.partition(".")
    name = rest.split(".", 1)[0]
    if section == "sample":
        owners = [s for s in SAMPLERS if name in s.keys or (name == "sde_window" and s.windows)]
        if owners:
            families = [f.name for f in FAMILIES if f.sampler in {s.name for s in owners}]
            samplers = f"{', '.join(s.name for s in owners)} sampler{'s' if len(owners) > 1 else ''}"
            return Problem(key, value, f"a setting of the {samplers}, which the {', '.join(families)} model "
                           f"famil{'ies' if len(families) > 1 else 'y'} sample with; the run's sampler does not have "
                           f"it", f"remove it, or use a model of {'those families' if len(families) > 1 else 'it'}: "
                           f"{_models_of(families)}")
    if section == "model":
        holders = [f.name for f in FAMILIES if name in f.own_keys]
        if holders:
            return Problem(key, value, f"a setting of the {' and '.join(holders)} model family; the run's model "
                           f"family does not have it", f"remove it, or use a model of that family: "
                           f"{_models_of(holders)}")
    return None


def _models_of(families: list[str]) -> str:
    """The model group's options of these families (conf/model/*.yaml), as overrides."""
    found = [path.stem for path in sorted((conf_dir() / "model").glob("*.yaml"))
             if (m := re.search(r"^family:\s*(\w+)", path.read_text(), flags=re.M)) and m.group(1) in families]
    return ", ".join(f"model={name}" for name in found) or "see conf/model"


def grammar_problem(e: Exception) -> Problem:
    """An override Hydra cannot parse (OverrideParseException), named by the override itself."""
    override = getattr(e, "override", "") or ""
    key, _, value = override.partition("=")
    reason = str(e).strip().splitlines()[0] if str(e).strip() else "cannot be parsed"
    return Problem(key.lstrip("+~") or "overrides", value if value or "=" in override else override,
                   f"not a valid override: {reason}",
                   "quote values with special characters for the shell and Hydra, e.g. 'key=\"a,b\"'; "
                   "see https://hydra.cc/docs/advanced/override_grammar/basic")


def to_tree(cfg: DictConfig) -> dict[str, Any]:
    problems = []
    for key in _missing_keys(cfg):
        problems.append(Problem(key, "???", "a value is required", f"set {key}=..."))
    if problems:
        raise ConfigError(problems)
    try:
        tree = _plain(cfg, resolve=True)
    except OmegaConfBaseException as e:  # ${oc.env:UNSET}, ${a_missing_key}, a self-reference, ...
        raise ConfigError([_interpolation_problem(e, cfg)]) from e
    tree.pop("hydra", None)
    return tree


def _plain(cfg: DictConfig, resolve: bool) -> dict[str, Any]:
    """OmegaConf.to_container of a DictConfig: a dict with str keys (its stub's return type is every container's)."""
    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=resolve))


def _interpolation_problem(e: OmegaConfBaseException, cfg: DictConfig) -> Problem:
    key = getattr(e, "full_key", None) or "config"
    raw = lookup(_plain(cfg, resolve=False), key)
    value = "" if raw is MISSING else raw
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    reason = re.sub(r"^\w+ raised while resolving interpolation: ", "", reason).strip('"')
    fix = "give a literal value or interpolate an existing key"
    env = re.search(r"Environment variable '([^']+)' not found", reason)
    if env:
        fix = f"export {env.group(1)}=..., or give a default: ${{oc.env:{env.group(1)},DEFAULT}}"
    elif "Recursive" in reason:
        reason, fix = "the interpolation refers to itself", "give a literal value"
    return Problem(key, value, f"cannot be resolved: {reason}", fix)


def _missing_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    out: list[str] = []
    for k in cfg.keys():
        if k == "hydra":
            continue
        name = str(k)  # a config tree's keys are str (DictConfig's stub allows bytes, ints and enums too)
        if OmegaConf.is_missing(cfg, k):
            out.append(f"{prefix}{name}")
            continue
        v = cfg._get_node(k)
        if isinstance(v, DictConfig):
            out.extend(_missing_keys(v, f"{prefix}{name}."))
    return out


def validate_tree(tree: dict[str, Any], overridden: frozenset[str] = frozenset()) -> Validated:
    tree = migrate(tree)
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as e:
        problems = [_schema_problem(err, tree) for err in e.errors()]
        pruned = rules.drop_null_leftovers(problems, tree, overridden)
        if pruned is None:
            raise ConfigError(rules.group_leftovers(problems, tree, overridden)) from None
        return validate_tree(pruned, overridden)
    problems = rules.check(cfg, tree, overridden)
    if problems:
        raise ConfigError(problems)
    return Validated(cfg, tree, rules.parity_report(cfg, tree), run_plan(cfg))


def validate(cfg: DictConfig, overridden: frozenset[str] = frozenset()) -> Validated:
    return validate_tree(to_tree(cfg), overridden)


def compose_and_validate(overrides: list[str]) -> Validated:
    return validate(compose(overrides), overridden_keys(overrides))


def _schema_problem(err: Mapping[str, Any], tree: dict[str, Any]) -> Problem:
    loc, model, union = _user_loc(err["loc"])
    key = ".".join(loc) or "config"
    kind = err["type"]
    value = err.get("input")
    if kind in ("union_tag_invalid", "union_tag_not_found"):  # `name` of a reward (or a component) picks its model
        field = err.get("ctx", {}).get("discriminator", "").strip("'\"") or "name"
        key = f"{key}.{field}" if loc else field
        choices = ", ".join(_tags(union))
        if kind == "union_tag_not_found":
            return Problem(key, None, "required key is missing", f"set {key} to one of: {choices}")
        # a registry entry nested under another section (GRPO's kl_gate_rewards) is a reward, as reward.components'
        what = ("reward" if len(loc) > 1 else loc[0]) if loc else "model"
        return Problem(key, err.get("ctx", {}).get("tag"), f"no {what} of this name goes here",
                       f"choose one of: {choices}")
    if kind == "not_registered":
        ctx = err.get("ctx", {})
        return Problem(key, value, f"no {ctx.get('what', 'entry')} of this name",
                       f"choose one of: {ctx.get('choices', '')} (registered in ddpo_tpu/catalog)")
    if kind == "extra_forbidden":
        if loc and loc[0] == "algorithm" and (p := _foreign_algorithm_key(key, value)) is not None:
            return p
        if model is not None:
            valid = sorted(model.model_fields)
        else:
            parent = lookup(tree, ".".join(loc[:-1])) if len(loc) > 1 else tree
            valid = sorted(k for k in parent if k != loc[-1]) if isinstance(parent, dict) else []
        return Problem(key, value, "unknown key", f"remove it; valid keys here: {', '.join(valid)}")
    if kind == "missing":
        return Problem(key, None, "required key is missing", f"set +{key}=...")
    expected = err["msg"]
    return Problem(key, value, expected[0].lower() + expected[1:], "see the comment of this key in conf/")


def _user_loc(loc: tuple) -> tuple[list[str], type[BaseModel] | None, Any]:
    """A pydantic error location as the user's dotted key, walked along the schema's types: the union members pydantic
    inserts are dropped (a reward's tag as in reward.remote.url, or `int` of `Literal["auto"] | int`). Also returns the
    model holding the last key (its fields are the valid keys there) and the union the location ends at, if any."""
    t: Any = RunConfig
    out: list[str] = []
    model = None
    for part in loc:
        t = _unannotated(t)
        if get_origin(t) in (Union, UnionType):  # pydantic names the member it tried: not part of the user's key
            t = next((m for m in get_args(t) if part in _tags(m)), None)
            continue
        if isinstance(part, str) and part.startswith(("function-", "literal[")) or part in _MEMBER_LABELS:
            continue  # a member label of a union the walk could not follow
        out.append(str(part))
        if isinstance(t, type) and issubclass(t, BaseModel):
            model, field = t, t.model_fields.get(str(part))
            t = field.annotation if field is not None else None
        elif get_origin(t) in (list, dict):
            model, t = None, get_args(t)[-1]
        else:
            model, t = None, None
    return out, model, _unannotated(t)


_MEMBER_LABELS = ("bool", "int", "str", "float", "none", "list[str]")


def _unannotated(t: Any) -> Any:
    return get_args(t)[0] if get_origin(t) is Annotated else t


def _tags(t: Any) -> list[str]:
    """The `name` values a tagged union accepts (or the one a model of it has)."""
    t = _unannotated(t)
    if get_origin(t) in (Union, UnionType):
        return [tag for m in get_args(t) for tag in _tags(m)]
    field = t.model_fields.get("name") if isinstance(t, type) and issubclass(t, BaseModel) else None
    return [str(a) for a in get_args(field.annotation)] if field is not None else []
