"""The training process's exit codes, and the one code a distributed rank and its launcher share. Here, at the bottom,
because the launcher (launch/process.py), the training process (worker.py), the rank launcher (torchrun.py), the
evaluation and ddpo-status (status/) all read them, and only the launcher starts processes."""

from __future__ import annotations

# exit codes of the training process (documented in the README)
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_BUSY = 3        # another training process holds this host's accelerator
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on SIGTERM after writing a checkpoint; the same command resumes
DOCUMENTED = (EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_BUSY, EXIT_PREEMPTED)
# A distributed rank's failure that the rank has said in its own `error:` line: its launcher (ddpo_tpu/torchrun.py)
# then adds none and exits 1. Internal between a rank and its launcher, never a code the front end returns. The exit
# code is the channel because it needs no disk: the `error` event that says the same is lost when the disk is full.
EXIT_RANK_SAID_WHY = 71
