"""A command whose run dir already holds a run: what it may change, judged before anything is written (no torch).

The same command again continues the run in its dir (resume=auto). Three ways that would go wrong are refused, one
line each, exit 2, naming the keys:
- what was trained differs (config/resume.py's keys: the model, the sampler, the algorithm, the batch...): the
  checkpoints would continue under other settings, and config.yaml would describe what never trained them;
- the run is complete and the command changes anything: nothing would run, and config.yaml would be rewritten to
  describe a run that never happened (the README's next commands kept run_name smoke and did exactly that);
- a numbered sweep job dir holding another point of an earlier sweep.
What a resume may change (the topology, the logger, epochs, how steps are compiled or synced) is allowed: config.yaml
then says how the run continues, and resumes.jsonl in the run dir records each such change with the epoch it took
effect at (record_changes, from the front end's job).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ddpo_tpu.rundir import checkpoint_layout as layout
from ddpo_tpu.config import resume
from ddpo_tpu.config.batch import flatten

CONFIG_FILE = "config.yaml"
RESUMES_FILE = "resumes.jsonl"  # one line per start that changed settings a resume may change
# keys whose change says nothing about the run (how this command reaches it: the same dir may be spelled another way)
_NOT_SETTINGS = ("resume", "force_resume", "output_root", "distributed.node_rank")  # (node_rank: per node)


def _saved(run_dir: Path) -> dict[str, Any] | None:
    """The config.yaml of the run in `run_dir` as a plain tree (None when there is none). Raises ValueError when it
    cannot be read."""
    from omegaconf import OmegaConf

    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # noqa: BLE001 -- any unreadable file is reported the same way
        raise ValueError(f"{path} cannot be read ({type(e).__name__})") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{path} is not a config")
    return tree


def _plain(tree: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(tree, default=str))


def changed_settings(then: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The flat keys whose values differ between two config trees, as (then, now); a key only one has (added by an
    upgrade, with the default that keeps the old behaviour) is not a change."""
    a, b = flatten(_plain(then)), flatten(_plain(now))
    return {k: (a[k], b[k]) for k in sorted(set(a) & set(b)) if a[k] != b[k] and not k.startswith(_NOT_SETTINGS)}


def epochs_done(run_dir: Path) -> int:
    """Epochs the run dir's newest complete checkpoint holds (0 without one)."""
    found = layout.complete(run_dir / layout.CHECKPOINTS)
    return layout.epoch_of(found[-1].name) + 1 if found else 0


def _shown(changes: dict[str, tuple[Any, Any]], limit: int = 4) -> str:
    text = ", ".join(f"{k}: {_v(a)} -> {_v(b)}" for k, (a, b) in list(changes.items())[:limit])
    return text + (f", and {len(changes) - limit} more" if len(changes) > limit else "")


def _v(value: Any) -> str:
    from ddpo_tpu.problems import as_typed

    return "(none)" if value is None else as_typed(value)


def _user_first(keys, overridden: tuple[str, ...]) -> list[str]:
    """The keys the command line set (a group's keys for group=option), in its order, before the others."""
    def rank(k: str) -> int:
        return next((i for i, o in enumerate(overridden) if k == o or k.startswith(o + ".")), len(overridden))

    return sorted(keys, key=rank)


def problems(validated, run_dir: Path, sweep_job: int | None = None, overridden: tuple[str, ...] = ()) -> list[str]:
    """Why this command must not continue the run already in `run_dir` ([] when it may, or there is none).
    `overridden`: the keys the command line set, in its order: named first."""
    cfg = validated.cfg
    if cfg.resume != "auto":  # never: starts over; a path: continues that checkpoint (checked when it loads)
        return []
    try:
        saved = _saved(run_dir)
    except ValueError as e:
        return [f"run_name={cfg.run_name}: {e} (use a new run_name, or move the run dir away)"]
    if saved is None:
        return []
    now = _plain(validated.tree)
    then, later = resume.resume_relevant(saved), resume.resume_relevant(now)
    trained = _user_first(resume.changed_keys(then, later), overridden)
    done = epochs_done(run_dir)
    if trained and not cfg.force_resume and sweep_job is not None:
        key = trained[0]
        was = ", ".join(f"{k}={then.get(k)}" for k in trained[:4]) + (", ..." if len(trained) > 4 else "")
        return [f"{key}={later.get(key)}: job dir {run_dir} holds an earlier run of another sweep point ({was}) "
                f"(start this sweep under a new name, e.g. run_name={cfg.run_name}-2, or repeat the old values to "
                f"continue it)"]
    if trained and not cfg.force_resume:
        shown = _shown({k: (then.get(k), later.get(k)) for k in trained})
        fresh = "" if done else f", or remove {run_dir} (it holds no checkpoint)"
        return [f"{trained[0]}={_v(later.get(trained[0]))}: {run_dir} holds run {cfg.run_name}, trained with other "
                f"settings ({shown}); the same run_name continues that run (start a new run: run_name="
                f"{cfg.run_name}-2, or repeat the old values to continue it{fresh}; force_resume=true continues it "
                f"under the new values)"]
    changes = changed_settings(saved, now)
    changes = {k: changes[k] for k in _user_first(changes, overridden)}
    if changes and done and done >= cfg.num_epochs:
        key, (_, value) = next(iter(changes.items()))
        return [f"{key}={_v(value)}: run {cfg.run_name} in {run_dir} is complete ({done} of {cfg.num_epochs} epochs), "
                f"so this command would train nothing and only rewrite its config.yaml ({_shown(changes)}) (start a "
                f"new run: run_name={cfg.run_name}-2, or raise num_epochs to continue it)"]
    return []


def record_changes(run_dir: Path, tree: dict[str, Any]) -> str | None:
    """Before config.yaml is rewritten for a resume: the settings this start changes, appended to resumes.jsonl with
    the epoch they take effect at; a line for the console (None when nothing changed or there was no run)."""
    try:
        saved = _saved(run_dir)
    except ValueError:
        return None
    if saved is None:
        return None
    changes = changed_settings(saved, tree)
    if not changes:
        return None
    epoch = epochs_done(run_dir)
    record = {"time": time.time(), "from_epoch": epoch,
              "changed": {k: {"was": a, "now": b} for k, (a, b) in changes.items()}}
    with open(run_dir / RESUMES_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return (f"resume: from epoch {epoch} with changed settings ({_shown(changes)}); config.yaml now says how the run "
            f"continues, {RESUMES_FILE} records the change")
