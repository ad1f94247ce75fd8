"""Where a run stands: `python -m ddpo_tpu.status RUN_DIR [--json | --brief] [--events N]` (console script
`ddpo-status`); given a sweep's multirun dir, one table row per point (sweep.py).

Three steps: read what the run leaves in its directory (read.py, `read_run`: config.yaml, events.jsonl,
metrics.jsonl, heartbeat.json, parity.json, checkpoints/, the end of train.log, and whether a live process holds the
run's lock), derive the facts from those values (facts.py, `derive`: a pure function, `now` passed in, returning one
typed frozen `Facts`; the state itself is decide.py's, the phase progress.py's), render them (render.py: `render`,
`render_brief`, or JSON through `Facts.to_json`). Never imports torch or numpy and never touches a device, so it is
instant and works on a machine without the training dependencies (it needs PyYAML and rich only).

The state comes from events (ddpo_tpu/rundir/events.py), never from console text. events.jsonl is appended by every
attempt of a run: the front end writes `worker_started` when it starts the training process and `worker_exited` (its
exit code) when it ends, whatever ended it; the training process writes `run_start`, the progress of each epoch, and
`run_complete`, `preempted` or `error`. An attempt opens at `worker_started` (or at a `run_start` that follows another
attempt's). Only the last attempt decides the state; an error of an earlier attempt is reported, not held against a
run that went on. The first rule that holds decides (the output names it):

  rule             state
  error_event      failed       the last attempt has an `error` event
  exit_code        failed       the last attempt ended with an exit code other than 0 and 75 (`worker_exited`)
  preempted        stopped      the last attempt has a `preempted` event or ended with exit 75 (the same command
                                resumes)
  complete         finished     the last attempt has `run_complete` or `already_complete`, or ended with exit 0
  lock_holder      running      a live process holds the run's lock (run_dir/lock or this host's accelerator lock)
  heartbeat_dead   stopped      heartbeat.json is older than 60 s and no live process holds the lock: killed (SIGKILL,
                                OOM, a lost host) with no exit recorded
  all_epochs       finished     every epoch has its metrics line, and no process is alive
  not_started      not started  no event and no metrics, and nothing written recently
  recent_activity  running      something was written within the staleness threshold (no lock holder seen on this
                                host: the run may live on another one)
  no_activity      stopped      nothing written for longer than the staleness threshold

Numbers (epochs, rewards, throughput, ETA) come from metrics.jsonl, where an epoch logged twice by a resumed run counts
once (the later line wins). The state layout comes from events.jsonl (metrics.jsonl in run dirs of older versions).
The last lines of train.log are shown to people, never read for the state.

Exit codes: 0 the run dir exists and has config.yaml, or the sweep dir has numbered job dirs (whatever their state);
2 otherwise.
"""

from ddpo_tpu.rundir.files import HEARTBEAT_FILE
from ddpo_tpu.status.cli import EXIT_NO_RUN, EXIT_OK, main, report
from ddpo_tpu.status.decide import RULES, Decision, Evidence, attempts, decide
from ddpo_tpu.status.facts import (DEFAULT_STALE_S, Checkpoints, EpochRow, Facts, HostPhase, HostTime, LastError,
                                   Parity, Reward, collect, derive)
from ddpo_tpu.status.progress import Compiling, describe
from ddpo_tpu.status.read import (Heartbeat, Holder, Layout, LogTail, Metrics, RunFiles, Stamped, read_metrics,
                                  read_run)
from ddpo_tpu.status.render import ASCII_BLOCKS, BLOCKS, plot_curve, render, render_brief, sparkline
from ddpo_tpu.status.sweep import Sweep, SweepRow, summarise

__all__ = ["ASCII_BLOCKS", "BLOCKS", "Checkpoints", "Compiling", "DEFAULT_STALE_S", "Decision", "EXIT_NO_RUN",
           "EXIT_OK", "EpochRow", "Evidence", "Facts", "HEARTBEAT_FILE", "Heartbeat", "Holder", "HostPhase",
           "HostTime", "LastError", "Layout", "LogTail", "Metrics", "Parity", "RULES", "Reward", "RunFiles", "Stamped",
           "Sweep", "SweepRow", "attempts", "collect", "decide", "derive", "describe", "main", "plot_curve",
           "read_metrics", "read_run", "render", "render_brief", "report", "sparkline", "summarise"]
