"""The training process. Started by the front end (ddpo_tpu.train) with an environment built from the config, so
torch and torch_xla are imported here, after every XLA/PJRT variable is final."""

from __future__ import annotations

import sys


def main() -> int:
    from omegaconf import OmegaConf

    from ddpo_tpu.config.compose import validate
    from ddpo_tpu.launch import env as envmod

    run_dir = envmod.run_dir_from_environment()
    if run_dir is None:
        print("ddpo_tpu.worker is started by `python -m ddpo_tpu.train`, not directly", file=sys.stderr)
        return 2
    validated = validate(OmegaConf.load(run_dir / "config.yaml"))
    from ddpo_tpu.launch.lock import AcceleratorBusy, AcceleratorLock
    from ddpo_tpu.launch.process import EXIT_BUSY

    lock = None
    path = envmod.accelerator_lock_path(validated.cfg)
    if path is not None:
        # taken before torch is imported (a refusal comes within seconds) and held until this process ends
        try:
            lock = AcceleratorLock(path, run_dir).acquire()
        except AcceleratorBusy as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BUSY
    from ddpo_tpu.ddpo.loop import run

    try:
        return run(validated, run_dir)
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
