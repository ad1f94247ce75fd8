"""The training process of the distributed execution: torchrun (torch.distributed.run, its own parser and elastic
agent, not a spawner of ours) starting one worker per device of this node, with three things around it.

- Locks: this process holds the run dir's lock (handed over by the front end) and the accelerator's for the whole
  job, as a single worker does; the ranks take none.
- Signals: torchrun runs in a thread, so its agent installs no signal handlers (it does only in the main thread) and
  a SIGTERM (preemption, the front end's forward) reaches the ranks from here, with no deadline: each rank finishes
  its checkpoint at the next safe point, where they agree to stop together. (torchrun's own handler gives ranks 30 s,
  then SIGKILL.)
- One line, one exit code: torchrun's ChildFailedError lists each failed rank (exit code or signal, pid, time); the
  documented codes pass through (75 preempted, 3 busy, 2 config) and any other end names the first rank that failed.

A rank that dies (SIGKILL, OOM) ends the job in bounded time: the agent sees it within --monitor-interval and
stops the other ranks (SIGTERM, SIGKILL after 30 s); a rank blocked in a collective on it fails when the dead rank's
connection closes and names it (proc/rankwatch.py's lost_peers). A rank that is stopped (SIGSTOP) or frozen ends
the job within distributed.hang_timeout_s, named by this launcher (proc/rankwatch.py's RankWatch).

One line per failure: a rank that reported its own cause (an `error` event: disk full, non-finite loss, a lost peer)
is not reported again as "rank N exited with code 1". A full disk refuses that event too, so the rank also says it
by its exit code (proc/exit_codes.py's EXIT_RANK_SAID_WHY), which needs no disk.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time


def _children() -> list:
    import psutil

    return psutil.Process().children(recursive=False)


def _forward(signum, _frame) -> None:
    for child in _children():
        try:
            child.send_signal(signum)
        except Exception:  # noqa: BLE001 -- gone already
            pass


def _reported_since(run_dir, start: float) -> bool:
    """Whether a rank wrote an `error` event (its own one line) into the run's events since `start`."""
    from ddpo_tpu.rundir.events import read_events

    return any(r.get("event") == "error" and r.get("time", 0) >= start for r in read_events(run_dir))


def _rank_log(run_dir, rank: int):
    return run_dir / "ranks" / f"rank{rank}.log"


def _own_line(run_dir, rank: int, offset: int) -> str:
    """The last `error:` line a rank other than 0 wrote into its log past `offset` (this job's part): its own cause,
    which only it printed."""
    try:
        with open(_rank_log(run_dir, rank), "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line[len("error: "):] for line in reversed(lines) if line.startswith("error: ")), "")


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def outcome(failures: dict, reported: bool = False, own=None) -> tuple[int, str]:
    """(exit code, a line or "") from torchrun's failures: rank -> ProcessFailure (exitcode, pid, timestamp).
    `reported`: a rank already said why the job failed, in its own line; no second one. Rank 0 ending with
    EXIT_RANK_SAID_WHY said it on the console (its output is the console's), which holds when the disk refused the
    `error` event behind `reported`. A rank other than 0 that gave its cause in its log (`own`: rank -> that line or
    "") has it quoted: only its log has it."""
    from ddpo_tpu.proc.exit_codes import EXIT_BUSY, EXIT_CONFIG, EXIT_FAILED, EXIT_PREEMPTED, EXIT_RANK_SAID_WHY

    codes = {rank: f.exitcode for rank, f in failures.items()}
    stopped = {EXIT_PREEMPTED, -signal.SIGTERM, 128 + signal.SIGTERM}  # a rank torchrun ended after another stopped
    if EXIT_PREEMPTED in codes.values() and set(codes.values()) <= stopped:
        return EXIT_PREEMPTED, ""
    for documented in (EXIT_BUSY, EXIT_CONFIG):
        if documented in codes.values():
            return documented, ""
    if reported or codes.get(0) == EXIT_RANK_SAID_WHY:
        return EXIT_FAILED, ""
    rank, first = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    if first.exitcode == EXIT_RANK_SAID_WHY:
        how = "failed and said why in its output"  # in its log only, which the disk may have refused
    elif first.exitcode < 0:
        how = f"was killed by {signal.Signals(-first.exitcode).name}"
    else:
        how = f"exited with code {first.exitcode}"
    where = "train.log" if rank == 0 else f"ranks/rank{rank}.log"
    cause = own(rank) if rank != 0 and own is not None else ""
    if cause:
        return EXIT_FAILED, f"error: rank {rank} (pid {first.pid}): {cause} (its output: {where})"
    return EXIT_FAILED, (f"error: rank {rank} (pid {first.pid}) {how} (its output: {where}); the other ranks were "
                         f"stopped; the same command resumes from the last checkpoint")


def main(argv: list[str] | None = None) -> int:
    from omegaconf import OmegaConf

    from ddpo_tpu.config.compose import validate
    from ddpo_tpu import env as envmod
    from ddpo_tpu.rundir.events import EventLog, Failed
    from ddpo_tpu.proc.exit_codes import EXIT_BUSY, EXIT_FAILED
    from ddpo_tpu.proc.rankwatch import RankWatch
    from ddpo_tpu.worker import hold_locks

    argv = list(sys.argv[1:] if argv is None else argv)
    run_dir = envmod.run_dir_from_environment()
    if run_dir is None:
        print("ddpo_tpu.torchrun is started by `python -m ddpo_tpu.train`, not directly", file=sys.stderr)
        return 2
    cfg = validate(OmegaConf.load(run_dir / envmod.config_file_from_environment())).cfg
    locks = hold_locks(cfg, run_dir)
    if locks is None:
        return EXIT_BUSY
    try:
        if cfg.tpu_topology.torchtpu:  # TorchTPU's launch variables for its ranks, set before they start
            from torch_tpu import distributed as tpu_dist

            tpu_dist.set_tpu_launch_env(nnodes=cfg.tpu_topology.hosts, nproc_per_node=cfg.tpu_topology.chips_per_host)
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        # the agent's own failure report is a page of text per rank: ours is one line (below)
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        args = parse_args(argv)
        result: dict = {}

        def agent() -> None:
            try:
                run(args)
            except ChildFailedError as e:
                result["failures"] = e.failures
            except BaseException as e:  # noqa: BLE001 -- reported below, with the rendezvous' own message
                result["error"] = e

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _forward)
        watch = RankWatch(run_dir, cfg.distributed.hang_timeout_s, world=cfg.tpu_topology.chips)
        start = time.time()
        marks = {r: _size(_rank_log(run_dir, r)) for r in range(cfg.tpu_topology.chips)}  # this job's part from here
        thread = threading.Thread(target=agent, name="torchrun-agent")
        thread.start()
        while thread.is_alive():  # the main thread stays free to take signals, and looks at the ranks
            thread.join(timeout=0.5)
            line = watch.check()
            if line:
                EventLog(run_dir).emit(Failed(line))  # prints its `error:` line too
        if watch.fired:
            return EXIT_FAILED
        if "failures" in result:
            code, line = outcome(result["failures"], _reported_since(run_dir, start),
                                 lambda r: _own_line(run_dir, r, marks.get(r, 0)))
            if line:
                print(line, file=sys.stderr, flush=True)
            return code
        if "error" in result:
            e = result["error"]
            first = str(e).splitlines()[0] if str(e) else ""
            print(f"error: torchrun could not run the job: {type(e).__name__}: {first}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        return 0
    finally:
        for lock in reversed(locks):
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
