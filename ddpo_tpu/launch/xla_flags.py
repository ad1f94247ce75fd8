"""Are the names in `xla.flags` flags this XLA knows? Checked before a run dir exists, without importing torch_xla.

XLA parses XLA_FLAGS when the training process creates its client and aborts the process on a name it does not know
(`F external/xla/xla/parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --xla_nonexistent_flag=1`, SIGABRT, 15-20 s
after the command, with the run dir written). A probe process that imports torch_xla takes as long, so the front end
reads the names from the library instead: every flag XLA registers is a string constant in torch_xla's `_XLAC`
extension, stored NUL-terminated. A name found there is accepted (a string that is not a flag could let a name
through; XLA then still refuses it at start); a name not found is refused with the closest known ones. When the
library is not installed here (a laptop that composes a TPU config) nothing is checked.

`xla.libtpu_init_args` are not checked: libtpu's flags live in libtpu, which this machine may not have, and its
behaviour on an unknown name has not been measured.
"""

from __future__ import annotations

import difflib
import importlib.util
import mmap
import re
from pathlib import Path

from ddpo_tpu.catalog.executions import EXECUTIONS

_NAME = re.compile(rb"(xla_[a-z0-9_]+)\0")


def library() -> Path | None:
    """torch_xla's extension (the XLA that parses XLA_FLAGS in the training process), found without loading it."""
    try:
        spec = importlib.util.find_spec("_XLAC")
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def flag_name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0]


def unknown(flags: list[str], lib: Path | None = None) -> list[tuple[int, str, list[str]]]:
    """(index, name, close known names) of each flag whose name the library does not have; [] when all are known or
    the library is not here."""
    lib = lib or library()
    if lib is None or not flags:
        return []
    try:
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            missing = [(i, name) for i, name in ((i, flag_name(fl)) for i, fl in enumerate(flags))
                       if m.find(name.encode() + b"\0") < 0]
            if not missing:
                return []
            known = {x.decode() for x in _NAME.findall(m) if b"_2e" not in x}  # not protobuf file symbols
    except (OSError, ValueError):
        return []
    return [(i, name, difflib.get_close_matches(name, known, n=3)) for i, name in missing]


def problems(xla_flags: list[str], execution: str) -> list[str]:
    """One line per unknown flag name, naming xla.flags[i]; [] for an execution that does not pass them to XLA (eager
    and distributed: XLA_FLAGS is set only where torch_xla runs, env.py runtime_variables)."""
    if not EXECUTIONS.get(execution).takes_xla_flags:
        return []
    out = []
    for i, name, close in unknown(list(xla_flags)):
        hint = f"did you mean {' or '.join('--' + c for c in close)}?" if close else "no flag of a similar name"
        out.append(f"xla.flags[{i}]={xla_flags[i]}: XLA has no flag named {name} (it would abort the training "
                   f"process at start; {hint}; the names XLA knows are its DebugOptions flags, "
                   f"https://github.com/openxla/xla/blob/main/xla/debug_options_flags.cc)")
    return out
