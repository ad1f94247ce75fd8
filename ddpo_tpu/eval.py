"""`python -m ddpo_tpu.eval TARGET [--base] [--out DIR] [key=value ...]` (console script `ddpo-eval`): the run's
evaluation (training/evaluation.py) of a checkpoint, a weights file or the base model, with the run's config.

TARGET
    a run dir             its newest complete checkpoint (the trained weights and, with train.ema, their average)
    a checkpoint dir      RUN/checkpoints/epoch_NNNN
    a weights file        RUN/weights/{final,final_ema,epoch_NNNN}.safetensors (the weights evaluated as they are)
--base                    the frozen model (nothing loaded): the "before" of every evaluation
--out DIR                 write DIR/<name>/ (default RUN/eval/<name>/); <name>: checkpoint_epoch_NNNN, weights_<stem>
                          or base
key=value                 overrides of the run's config (evaluation.split=test, evaluation.rewards=[...], another
                          tpu_topology=...), checked as the trainer checks them

Like `ddpo-train`, the front end never imports torch: it reads and checks everything, refuses bad input in one line
(exit 2), writes the config into the output dir and starts the evaluation process (`--worker`, under torchrun for
the distributed topologies) on the run's runtime. The checkpoint's own evaluation is reproduced exactly: the same
plan, seeds, sampler and weights give the same images and scores as the run's in-training evaluation of that epoch
(tests/e2e/test_evaluation_e2e.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REQUEST = "eval_request.json"  # what the worker evaluates (written by the front end beside config.yaml)
USAGE = "usage: python -m ddpo_tpu.eval RUN_DIR|CHECKPOINT_DIR|WEIGHTS.safetensors [--base] [--out DIR] [key=value ...]"


class EvalInputError(ValueError):
    """Bad input, said in one line."""


def _fail(line: str, code: int = 2) -> None:
    print(f"ddpo-eval: error: {line}", file=sys.stderr)
    sys.exit(code)


def parse(argv: list[str]) -> tuple[Path, bool, Path | None, list[str]]:
    target, base, out, overrides = None, False, None, []
    it = iter(argv)
    for a in it:
        if a == "--base":
            base = True
        elif a == "--out":
            out = next(it, None)
            if out is None:
                raise EvalInputError("--out needs a directory")
            out = Path(out).expanduser()
        elif a.startswith("--out="):
            out = Path(a.split("=", 1)[1]).expanduser()
        elif "=" in a and not a.startswith("-"):
            overrides.append(a)
        elif a.startswith("-"):
            raise EvalInputError(f"unknown option {a} ({USAGE})")
        elif target is None:
            target = Path(a).expanduser()
        else:
            raise EvalInputError(f"a second target {a}: one run dir, checkpoint or weights file at a time")
    if target is None:
        raise EvalInputError(f"no run dir given ({USAGE})")
    return target, base, out, overrides


def resolve(target: Path, base: bool) -> tuple[Path, dict]:
    """(the run dir, the request: what to load, the epoch it stands for, the output name)."""
    from ddpo_tpu.rundir.checkpoint_layout import CHECKPOINTS, STATE_FILE, complete, epoch_of

    if not target.exists():
        raise EvalInputError(f"{target}: no such run dir, checkpoint or weights file")
    if target.is_file():
        if target.suffix != ".safetensors" or target.parent.name != "weights":
            raise EvalInputError(f"{target}: not a run's weights file (RUN/weights/NAME.safetensors), checkpoint "
                                 "or run dir")
        run_dir = target.parent.parent
        epoch = epoch_of(target.stem)
        kind = {"kind": "weights", "path": str(target.resolve()), "name": f"weights_{target.stem}",
                "epoch": epoch}
    elif (target / STATE_FILE).is_file():
        run_dir = target.parent.parent
        kind = {"kind": "checkpoint", "path": str(target.resolve()), "name": f"checkpoint_{target.name}"}
    elif (target / "config.yaml").is_file():
        run_dir = target
        done = complete(target / CHECKPOINTS)
        if not done and not base:
            raise EvalInputError(f"{target}: no complete checkpoint in {target / CHECKPOINTS} (fix: --base for the "
                                 "frozen model, or name a weights file)")
        kind = ({"kind": "checkpoint", "path": str(done[-1].resolve()), "name": f"checkpoint_{done[-1].name}"}
                if done else {})
    else:
        raise EvalInputError(f"{target}: neither a run dir (no config.yaml), a checkpoint (no {STATE_FILE}) nor a "
                             "weights file")
    if not (run_dir / "config.yaml").is_file():
        raise EvalInputError(f"{run_dir}: the run dir of {target} has no config.yaml")
    if base:
        kind = {"kind": "base", "name": "base"}
    return run_dir, kind


def choose_groups(tree: dict, overrides: list[str]) -> tuple[list[str], list[str]]:
    """Apply the group choices among the overrides (`tpu_topology=cpu_dist2`: a conf/GROUP/NAME.yaml) to the run's
    config as the trainer's composition would (the group's section replaced by that file); returns (the groups
    chosen, the other overrides). A file that composes further (a defaults list, a global package) is
    refused: give its keys one by one."""
    from omegaconf import OmegaConf

    from ddpo_tpu.config.compose import conf_dir

    chosen, rest = [], []
    for o in overrides:
        key, value = o.split("=", 1)
        path = conf_dir() / key / f"{value}.yaml"
        if "." in key or not path.is_file():
            rest.append(o)
            continue
        head = path.read_text().splitlines()[:1]
        loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if head != [f"# @package {key}"] or not isinstance(loaded, dict) or "defaults" in loaded:
            raise EvalInputError(f"{o}: {path} composes more than the {key} section; give its keys as "
                                 f"{key}.KEY=VALUE overrides instead")
        tree[key] = loaded
        chosen.append(o)
    return chosen, rest


def front_end(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    from ddpo_tpu import env as envmod
    from ddpo_tpu.config.compose import validate_tree
    from ddpo_tpu.launch import process
    from ddpo_tpu.problems import ConfigError

    try:
        target, base, out, overrides = parse(argv)
        run_dir, request = resolve(target, base)
    except EvalInputError as e:
        _fail(str(e))
    tree = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    try:
        groups, overrides = choose_groups(tree, overrides)
        merged = OmegaConf.merge(OmegaConf.create(tree), OmegaConf.from_dotlist(overrides))
    except EvalInputError as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 -- OmegaConf's parse errors, as one line
        _fail(f"overrides {' '.join(overrides)}: {str(e).splitlines()[0]}")
    tree = OmegaConf.to_container(merged, resolve=True)
    if not tree["evaluation"].get("every_n_epochs"):  # the run did not evaluate: its evaluation keys as they are
        tree["evaluation"]["every_n_epochs"] = 1
    try:
        validated = validate_tree(tree, frozenset(o.split("=", 1)[0] for o in overrides))
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"ddpo-eval: error: {line}", file=sys.stderr)
        return process.EXIT_CONFIG
    where = (out or run_dir / "eval") / request["name"]
    where.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(validated.tree), where / "config.yaml")
    (where / REQUEST).write_text(json.dumps(request, indent=1) + "\n")
    env = envmod.child_environment(validated.cfg, where.resolve())
    cmd = [("ddpo_tpu.eval" if c == process.WORKER_MODULE else c) for c in process.training_command(validated.cfg)]
    print(f"ddpo-eval: {request.get('path', 'the base model')} -> {where}", flush=True)
    return subprocess.call([*cmd, "--worker"], env=env)


def worker() -> int:
    """The evaluation process (one rank of it under torchrun): the Trainer's parts, the weights, one evaluation."""
    from omegaconf import OmegaConf

    from ddpo_tpu import env as envmod
    from ddpo_tpu.config.compose import validate

    where = envmod.run_dir_from_environment()
    if where is None:
        print("ddpo_tpu.eval --worker is started by `python -m ddpo_tpu.eval`, not directly", file=sys.stderr)
        return 2
    validated = validate(OmegaConf.load(where / envmod.config_file_from_environment()))
    request = json.loads((where / REQUEST).read_text())
    ranks = envmod.torchrun_ranks() if validated.cfg.tpu_topology.spec.torchrun else None
    locks = []
    if ranks is None:  # under torchrun the launcher holds them
        from ddpo_tpu.worker import hold_locks

        locks = hold_locks(validated.cfg, where)
        if locks is None:
            return 3
    try:
        return evaluate(validated, where, request)
    finally:
        for lock in reversed(locks):
            lock.release()


def evaluate(validated, where: Path, request: dict) -> int:
    from types import SimpleNamespace

    from ddpo_tpu.display.console import quiet_third_party
    from ddpo_tpu.display.tracking import Tracker
    from ddpo_tpu.rundir import events as ev
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import checkpoint_files as ckpt
    from ddpo_tpu.training.loop import Trainer

    quiet_third_party()
    cfg = validated.cfg
    rt = make_runtime(cfg)
    if rt.is_main:
        (where / "metrics.jsonl").unlink(missing_ok=True)  # this evaluation's record only
    rt.barrier()
    t = Trainer(cfg, rt, RunDir(where), tree=validated.tree, stop=SimpleNamespace(requested=False),
                events=ev.EventLog(where, rt.is_main))
    t.report.tracker = Tracker()  # no tracker run: the files and metrics.jsonl are the output
    epoch = ev.BEFORE_TRAINING
    kind = request["kind"]
    if kind == "checkpoint":
        loaded = ckpt.load(Path(request["path"]), validated.tree, force=True)  # any config: it is only evaluated
        current = t.family.trainable_state()
        t.family.load_trainable_state({k: rt.place_like(v, current[k]) for k, v in loaded.trainable.items()})
        t.state.load_state_dict(loaded.optimizer)  # the EMA with it
        t.state.global_step, epoch = loaded.global_step, loaded.epoch
    elif kind == "weights":
        from safetensors.torch import load_file

        current = t.family.trainable_state()
        weights = load_file(request["path"])
        missing = sorted(set(current) - set(weights))
        if missing:
            raise SystemExit(f"ddpo-eval: error: {request['path']}: {len(missing)} trained tensor(s) of this config "
                             f"missing (e.g. {missing[0]}): weights of another model or adapter")
        t.family.load_trainable_state({k: rt.place_like(weights[k], current[k]) for k in current})
        if t.state.ema is not None:  # the file is what is evaluated: no average over it
            t.state.ema = None
        epoch = request["epoch"] if request.get("epoch") is not None else cfg.num_epochs - 1
    rt.sync()
    rec = t.evaluate(epoch, out_root=where.parent, name=where.name)
    if not rec:  # a SIGTERM during the pass: nothing summarised; the same command evaluates again
        if rt.is_main:
            print(f"ddpo-eval: stopped before the pass finished; {where} has no summary.json", flush=True)
        rt.close()
        from ddpo_tpu.proc.exit_codes import EXIT_PREEMPTED

        return EXIT_PREEMPTED
    if rt.is_main:
        print(f"ddpo-eval: {rec['num_images']} images of {rec['num_prompts']} prompts: " + ", ".join(
            f"{k} {v['mean']:.4f} +- {v['std']:.4f}" for k, v in rec["rewards"].items()
            if v["mean"] is not None) + f"; {where / 'summary.json'}", flush=True)
    rt.barrier()
    rt.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--help", "-h") for a in argv):
        print(__doc__)
        return
    if "--worker" in argv:
        sys.exit(worker())
    sys.exit(front_end(argv))


if __name__ == "__main__":
    main()
