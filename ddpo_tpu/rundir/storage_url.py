"""gs:// URLs and where a bucket run dir is staged on this machine: pure code (no gcsfs, no torch), so config rules,
the front end and ddpo-status read URLs without importing the bucket client. The bucket itself is
ddpo_tpu/rundir/storage.py."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SCHEME = "gs"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
# Google's bucket naming rules (the common case: no dotted names over 63 characters)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
EXAMPLE = "gs://my-bucket/ddpo-runs"


def is_url(value: str) -> bool:
    return bool(_URL.match(str(value).strip()))


@dataclass(frozen=True)
class Url:
    bucket: str
    prefix: str = ""  # no leading or trailing "/"

    @property
    def path(self) -> str:
        """The fsspec path (no scheme)."""
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket

    def join(self, *parts: str) -> Url:
        extra = "/".join(p.strip("/") for p in parts if p.strip("/"))
        return Url(self.bucket, f"{self.prefix}/{extra}".strip("/") if extra else self.prefix)

    def __str__(self) -> str:
        return f"{SCHEME}://{self.path}"


def url_problem(value: str) -> tuple[str, str] | None:
    """Why `value` is not a usable gs:// URL, as (reason, fix); None when it is one (or is not a URL at all)."""
    m = _URL.match(str(value).strip())
    if not m:
        return None
    scheme, rest = m.group(1), m.group(2)
    fix = f"e.g. output_root={EXAMPLE}"
    if scheme.lower() != SCHEME:
        return f"{scheme}:// is not supported (only gs:// buckets and local directories)", fix
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        return "no bucket name after gs://", fix
    if not _BUCKET.match(bucket) or ".." in bucket:
        return (f"{bucket!r} is not a valid bucket name (3-63 characters: lowercase letters, digits, '-', '_', '.'; "
                f"starting and ending with a letter or digit)", fix)
    parts = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
    if any(p in ("", ".", "..") for p in parts):
        return "the path after the bucket has an empty, '.' or '..' part", fix
    if any(ord(c) < 32 or c in "#[]*?" for c in prefix):
        return "the path after the bucket has a control character or one of # [ ] * ?", fix
    return None


def parse(value: str) -> Url:
    problem = url_problem(value)
    if problem is not None or not is_url(value):
        raise ValueError(f"{value!r}: {problem[0] if problem else 'not a gs:// URL'}")
    bucket, _, prefix = _URL.match(str(value).strip()).group(2).partition("/")
    return Url(bucket, prefix.strip("/"))


def local_root(output_root: str) -> str:
    """Where run dirs of `output_root` live on this machine: itself for a local path, the staging dir of a bucket
    URL (also Hydra's `hydra.run.dir` root, through the `ddpo_local_root` resolver)."""
    if not is_url(output_root) or url_problem(output_root) is not None:
        return output_root
    from ddpo_tpu.env import cache_root  # the one module that reads the environment

    url = parse(output_root)
    return str(cache_root() / "runs" / url.bucket / url.prefix if url.prefix else cache_root() / "runs" / url.bucket)


def remote_run_dir(output_root: str, run_dir: Path) -> Url | None:
    """The bucket copy of a local run dir (None for a local output_root): the same path below the root."""
    if not is_url(output_root):
        return None
    rel = Path(run_dir).resolve().relative_to(Path(local_root(output_root)).expanduser().resolve())
    return parse(output_root).join(*rel.parts)
