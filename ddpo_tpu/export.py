"""`python -m ddpo_tpu.export RUN_DIR [NAME ...]` (the `ddpo-export` script): a run's saved weights in the formats
users load, written beside them in RUN_DIR/weights/ (training/export.py says what each folder holds and how to load
it).

NAME is a weights file of the run without its suffix: `final`, `final_ema`, `epoch_0003`. Without NAME: `final` and
`final_ema` where the run wrote them, else its newest `epoch_NNNN`. The run's config.yaml says what was trained (its
`model` section: the family, the LoRA rank, alpha and targets, the base checkpoint). The end of a training run
exports `final` (and `final_ema`) by itself; this command is for other epochs, and for runs made before the exporter.

Bad input (no such run dir, no config.yaml, no such weights file) is refused in one `error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddpo-export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run dir (holds config.yaml and weights/)")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="weights files to export, without .safetensors (default: final and final_ema, else the "
                        "newest epoch)")
    return p


def default_names(weights_dir: Path) -> list[str]:
    """What to export when no NAME is given: final and final_ema where present, else the newest epoch."""
    finals = [n for n in ("final", "final_ema") if (weights_dir / f"{n}.safetensors").is_file()]
    if finals:
        return finals
    epochs = sorted(p.stem for p in weights_dir.glob("epoch_*.safetensors"))
    return epochs[-1:]


def model_config(run_dir: Path):
    """The `model` section of the run's config.yaml, validated (ddpo_tpu/config/schema.py ModelConfig)."""
    from ddpo_tpu.config.compose import migrate
    from ddpo_tpu.config.schema import ModelConfig
    from ddpo_tpu.launch.saved_run import CONFIG_FILE, _saved

    tree = _saved(run_dir)
    if tree is None:
        raise ValueError(f"{run_dir}: no {CONFIG_FILE} here, so not a ddpo_tpu run dir (give the run's directory)")
    model = migrate(tree).get("model")
    try:
        return ModelConfig.model_validate(model)
    except Exception as e:  # noqa: BLE001 -- pydantic's message, first line
        raise ValueError(f"{run_dir / CONFIG_FILE}: its model section cannot be read "
                         f"({str(e).splitlines()[0][:200]})") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir: Path = args.run_dir
    try:
        if not run_dir.is_dir():
            raise ValueError(f"{run_dir}: no such run dir")
        model = model_config(run_dir)
        weights = run_dir / "weights"
        names = args.names or default_names(weights)
        if not names:
            raise ValueError(f"{weights}: no weights files to export (the run has not finished an epoch)")
        missing = [n for n in names if not (weights / f"{n}.safetensors").is_file()]
        if missing:
            have = sorted(p.stem for p in weights.glob("*.safetensors"))
            raise ValueError(f"{weights}: no weights file {missing[0]}.safetensors (have: "
                             f"{', '.join(have) or 'none'})")
        from ddpo_tpu.training.export import export_saved, family_export

        family_export(model.family)  # an unknown family: one line before any work
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for name in names:
        for folder in export_saved(weights, name, model):
            print(f"ddpo-export: {name} -> {folder}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
