"""An OCR recogniser that never answers on one rank (tests/e2e/test_rank_hang.py), reached through the OCR reward's
`module:function` key: `reward=ocr reward.recognizer=tests.helpers.hang_reward:read`. Its process stays healthy (the
beat thread runs) while its reward call blocks, as a call to a reward server that never answers does.

Environment (the training processes inherit it from the test's front end):
    HANG_TEST_FLAG   a file: while it exists, rank HANG_TEST_RANK (default 1) blocks from its call HANG_TEST_AFTER
                     on (0-based, counted per process); the test removes it, and the same command then runs through
    HANG_TEST_AFTER  the first call that blocks (default 0)
Each blocking call writes `<flag>.hung` (the time it started) first: the test measures the bound from there.
    SIGTERM_TEST_FLAG  a file: while it exists, call SIGTERM_TEST_AT (0-based) removes it and sends SIGTERM to the
                       process's parent (the front end, which forwards it: a `kill -TERM` of the command), once
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_calls = [0]


def read(images):
    call, _calls[0] = _calls[0], _calls[0] + 1
    flag = os.environ.get("HANG_TEST_FLAG")
    if flag and os.environ.get("RANK") == os.environ.get("HANG_TEST_RANK", "1") \
            and call >= int(os.environ.get("HANG_TEST_AFTER", "0")) and Path(flag).exists():
        Path(flag + ".hung").write_text(f"{time.time()}\n")
        while Path(flag).exists():
            time.sleep(0.2)
    stop = os.environ.get("SIGTERM_TEST_FLAG")
    if stop and call == int(os.environ.get("SIGTERM_TEST_AT", "0")) and Path(stop).exists():
        Path(stop).unlink()
        os.kill(os.getppid(), signal.SIGTERM)
    return ["open"] * len(images)
