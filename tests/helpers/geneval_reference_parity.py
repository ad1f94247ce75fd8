"""Compare ddpo_tpu.rewards.geneval's rules with reward-server's own functions on random detections and metadata.

The reference's code is read at run time from a local clone (it is not copied into this repo): its rule functions
(yifan123/reward-server@92ac29f reward_server/gen_eval.py:109-264: compute_iou, relative_position, evaluate,
evaluate_reward) and its detection filter (:273-289) are executed with a stub colour classifier, and both sides score
the same cases; scores are compared with ==. Needs the network once for the clone; not part of the test suite.

    git clone https://github.com/yifan123/reward-server /tmp/reward-server
    PYTHONPATH=. python -m tests.helpers.geneval_reference_parity /tmp/reward-server/.git [N]
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np

from ddpo_tpu.rewards import geneval as ours

COMMIT = "92ac29f"
CLASSES = ("cat", "dog", "cup")
RELATIONS = ("left of", "right of", "above", "below")


def colour_of_box(box) -> str:
    """A deterministic stand-in for CLIP: one of four colours from the box coordinates (hits and misses both)."""
    return ours.COLORS[int(abs(box[0] * 7 + box[1] * 13 + box[2] * 3)) % 4]


def reference_functions(git_dir: str) -> dict:
    src = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{COMMIT}:reward_server/gen_eval.py"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    block = lambda a, b: textwrap.dedent("\n".join(src[a - 1:b]))  # noqa: E731 -- 1-based, inclusive
    ns = {"np": np, "COLORS": list(ours.COLORS), "POSITION_THRESHOLD": 0.1, "THRESHOLD": 0.3,
          "COUNTING_THRESHOLD": 0.9, "MAX_OBJECTS": 16, "NMS_THRESHOLD": 1.0,
          "color_classification": lambda image, objs, cls: [colour_of_box(o[0]) for o in objs]}
    exec(block(109, 264), ns)  # noqa: S102
    exec("def keep(bbox, classnames, metadata, segm=None):\n" + textwrap.indent(block(273, 289), "    ")  # noqa: S102
         + "\n    return detected\n", ns)
    return ns


def random_case(rng: random.Random):
    include = []
    for i in range(rng.randint(0, 3)):
        req = {"class": rng.choice(CLASSES), "count": rng.randint(1, 3)}
        if rng.random() < 0.4:
            req["color"] = rng.choice(ours.COLORS[:4])
        if i > 0 and rng.random() < 0.5:
            req["position"] = [rng.choice(RELATIONS), rng.randrange(i)]
        include.append(req)
    meta = {"tag": rng.choice(ours.TAGS), "include": include}
    if rng.random() < 0.3:
        meta["exclude"] = [{"class": rng.choice(CLASSES), "count": rng.randint(1, 3)}]
    raw = {}
    for c in CLASSES:
        raw[c] = []
        for _ in range(rng.randint(0, 5)):
            x, y = rng.randint(0, 50), rng.randint(0, 50)
            raw[c].append((np.array([x, y, x + rng.randint(1, 20), y + rng.randint(1, 20)], float),
                           round(rng.random(), 2)))
    return meta, raw


def main(git_dir: str, n: int = 20000) -> int:
    ref = reference_functions(git_dir)
    classify = lambda image, objs, cls: [colour_of_box(o[0]) for o in objs]  # noqa: E731
    rng, mismatches = random.Random(0), 0
    for _ in range(n):
        meta, raw = random_case(rng)
        bbox = [np.array([[*b, s] for b, s in raw[c]]).reshape(-1, 5) for c in CLASSES]
        theirs = ref["keep"](bbox, CLASSES, meta)
        strict, score, _ = ref["evaluate_reward"](None, theirs, meta)
        lenient, _ = ref["evaluate"](None, theirs, meta)
        mine = ours.keep_detections(raw, meta["tag"])
        got = (*ours.evaluate_reward(None, mine, meta, classify), ours.evaluate(None, mine, meta, classify))
        if got != (strict, score, lenient):
            mismatches += 1
            if mismatches <= 3:
                print("mismatch:", meta, (strict, score, lenient), got)
    print(f"{n} random cases, {mismatches} mismatches (strict, score with ==, lenient)")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *(int(a) for a in sys.argv[2:3])))
