"""Other training runs on this machine's CPU. A CPU run takes no accelerator lock (several may share a host on
purpose), but two runs on a small machine slow each other many times over (70x measured for two digits runs on 2
cores), so a CPU training process says so at its start, naming the other runs: their training processes are found by
their command (`-m ddpo_tpu.worker` or `-m ddpo_tpu.torchrun`) and their run dir by their environment."""

from __future__ import annotations

from pathlib import Path

_MODULES = ("ddpo_tpu.worker", "ddpo_tpu.torchrun")


def other_runs(run_dir: Path) -> dict[str, int]:
    """run dir -> the lowest pid of a training process of another run on this machine (this user's processes: the
    environment of another user's cannot be read)."""
    import psutil

    from ddpo_tpu.env import run_dir_from_environment

    me = psutil.Process()
    ours = {me.pid, *(p.pid for p in me.parents())}
    here = Path(run_dir).resolve()
    found: dict[str, int] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if proc.pid in ours or "-m" not in cmd or not any(m in cmd for m in _MODULES):
            continue
        try:
            other = run_dir_from_environment(proc.environ())
        except psutil.Error:
            continue
        if other is None or other.resolve() == here:
            continue
        found[str(other)] = min(found.get(str(other), proc.pid), proc.pid)
    return found


def busy_line(run_dir: Path) -> str | None:
    """One note naming the other runs training on this machine, or None when there are none."""
    try:
        others = other_runs(run_dir)
    except Exception:  # noqa: BLE001 -- advisory: a process table that cannot be read says nothing
        return None
    if not others:
        return None
    named = ", ".join(f"{d} (pid {pid})" for d, pid in sorted(others.items()))
    return (f"note: this machine is busy: another training run shares its CPU cores, so both run slower: {named} "
            f"(`ddpo-status RUN_DIR` shows its progress)")
