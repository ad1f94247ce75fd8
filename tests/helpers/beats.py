"""Rank beat files as proc/rankwatch.py's RankBeat writes them, for the rank-watch tests, and a poll helper."""

from __future__ import annotations

import json
import os
import time

from ddpo_tpu.proc import rankwatch


def write_beat(run_dir, rank: int, pid: int, age_s: float = 0.0, **state) -> None:
    """Rank `rank`'s beat file (pid, host, and any of its main thread's wait state), `age_s` old."""
    path = rankwatch.beat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "host": os.uname().nodename, **state}))
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))


def wait_for(check, limit_s: float):
    """check()'s first truthy result within limit_s seconds (polled every 0.1 s), else None."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        out = check()
        if out:
            return out
        time.sleep(0.1)
    return None
