"""What people see: the start of a run on one screen, the live progress of the training process, and the quieting
of third-party messages that say nothing about the run. Never touches a device.

The start names the run dir, what is trained (model, algorithm, reward, topology) in a few lines and the parity
verdict; the whole config is in the run dir's config.yaml (and `--cfg job` prints it). The progress is drawn from
the typed events of events.jsonl (ddpo_tpu/rundir/events.py) by `ProgressView`, never from console text.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ddpo_tpu.config.compose import Validated

def parity_table(validated: Validated) -> Table:
    table = Table(title=f"parity: {validated.cfg.parity.name}", show_lines=False)
    for col in ("constraint", "target", "effective", "ok"):
        table.add_column(col)
    for row in validated.report:
        target = "-" if row["target"] is None else str(row["target"])
        table.add_row(row["constraint"], target, str(row["effective"]), "yes" if row["ok"] else "NO")
    return table


# --- the start -------------------------------------------------------------------------------------------------------

def start_lines(validated: Validated, run_dir: Path) -> list[tuple[str, str]]:
    """(label, text) rows of the start screen: what is trained, where, and whether it is on parity."""
    from ddpo_tpu.catalog import family

    cfg, plan = validated.cfg, validated.plan
    m, s, t, topo = cfg.model, cfg.sample, cfg.train, cfg.tpu_topology
    replicas = topo.replicas
    per_epoch = s.batch_size * s.num_batches_per_epoch * replicas
    per_update = t.batch_size * t.gradient_accumulation_steps * replicas
    source = m.pretrained or (f"local build `{m.builder}`" if m.builder else "?")
    lora = f"LoRA rank {m.lora.rank}" if m.lora.enabled else f"full {family(m.family).denoiser}"
    algo = cfg.algorithm.name
    group = getattr(cfg.algorithm, "group_size", None)
    rows = [
        ("run", f"{cfg.run_name}: {cfg.num_epochs} epochs, seed {cfg.seed}"),
        ("run dir", str(run_dir)),
        ("model", f"{m.name} ({m.family}, {source}, {m.dtype}), {lora}"),
        ("sampler", ", ".join([f"{s.name}", f"{s.num_steps} steps",
                               # the sampler's own noise key (DDIM's eta, the flow SDE's noise level): the one it sets
                               *[f"{k.replace('_', ' ')} {getattr(s, k)}" for k in ("eta", "noise_level")
                                 if getattr(s, k, None) is not None],
                               f"guidance {s.guidance_scale}"])),
        ("algorithm", f"{algo}{f' (groups of {group})' if group else ''}: {per_epoch} samples/epoch "
                      f"({s.batch_size} x {s.num_batches_per_epoch} batches x {replicas} replica(s)), "
                      f"{per_update} per update, {plan.train_timesteps} trained timesteps, lr {t.learning_rate:g}"),
        ("reward", f"{cfg.reward.name}; prompts {cfg.prompts.name}"),
        ("topology", f"{topo.name}: {topo.accelerator}, {topo.execution}, {topo.chips} chip(s)"
                     + (f", mesh dp {topo.mesh.dp} x fsdp {topo.mesh.fsdp}" if topo.spec.spmd else "")),
        ("logger", _logger_line(cfg.logger, run_dir)),
        ("parity", parity_verdict(validated)),
        # the decisions validation made once (config/plan.py), as the training process will use them
        ("plan", plan.describe()),
        ("config", f"{run_dir / 'config.yaml'} (the whole config; `--cfg job` prints it)"),
    ]
    return rows


def _logger_line(logger, run_dir: Path) -> str:
    parts = ["metrics.jsonl", "reward_curve.png"]
    if logger.name == "wandb":
        parts.append(f"wandb ({logger.mode}, project {logger.project})")
    if logger.name == "tensorboard" or getattr(logger, "tensorboard", False):
        parts.append(f"tensorboard ({run_dir / 'tensorboard'})")
    return ", ".join(parts)


def parity_verdict(validated: Validated) -> str:
    report, name = validated.report, validated.cfg.parity.name
    pinned = [r for r in report if r["target"] is not None]
    bad = [r for r in pinned if not r["ok"]]
    if not pinned:
        return f"{name}: nothing pinned (parity.txt has the effective batch arithmetic)"
    if bad:
        return f"{name}: {len(bad)} of {len(pinned)} pinned values differ: " + ", ".join(
            f"{r['constraint']} {r['effective']} (target {r['target']})" for r in bad[:3])
    return f"{name}: all {len(pinned)} pinned values hold (parity.txt)"


def print_start(validated: Validated, run_dir: Path) -> None:
    console = Console(highlight=False)
    width = max(len(label) for label, _ in start_lines(validated, run_dir))
    console.print("[bold]ddpo_tpu[/bold]")
    for label, text in start_lines(validated, run_dir):
        console.print(f"  {label:<{width}}  {escape(text)}", soft_wrap=True)  # a terminal wraps; a log keeps lines
    with open(run_dir / "parity.txt", "w") as f:
        Console(file=f, width=120, no_color=True).print(parity_table(validated))


# --- third-party messages ---------------------------------------------------------------------------------------------

# transformers 5 warns, the first time anything (here: diffusers' pipeline modules) touches the name
# `CLIPImageProcessor` or `SiglipImageProcessor` without torchvision, that it falls back to the PIL processor. The
# JPEG rewards and the tiny builds use no image processor; the aesthetic reward imports the PIL one by name. Dropped
# by this exact text on that one logger, so every other transformers warning still shows.
# On the distributed execution (torch.compile in every rank): dynamo says once that it compiles around our
# `record_function` phase labels, and inductor's C++ toolchain probe says a CPU machine has no CUDA runtime. Neither
# concerns the run; torch's other warnings on these loggers still show.
_NOT_OURS = {
    "transformers.utils.import_utils": ("requires torchvision (not installed); falling back to",),
    "torch._dynamo.variables.torch": ("Profiler function ",),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
}

# Lines a library prints straight to the training process's stdout (C++ std::cout, no logger to filter): gloo's
# connection count, once per process group. train.log keeps them; the console does not show them.
_NOT_OURS_LINES = (b"[Gloo] Rank ",)


def third_party_line(raw: bytes) -> bool:
    """A line of the training process's output that a library printed without a logger and that says nothing about
    the run (dropped from the console by the front end, kept in train.log)."""
    return raw.lstrip().startswith(_NOT_OURS_LINES)


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 -- a broken record is not ours to judge
            return True
        return not any(f in message for f in self.fragments)


def quiet_third_party() -> None:
    """In the training process, before the model loads: drop the third-party messages that do not concern the run.
    Its stdout is a pipe to the front end, where the load/save progress bars of transformers and diffusers (a local
    model loads in a fraction of a second) arrive as carriage-return noise; those bars are turned off.
    huggingface_hub's download bars are kept (a first download of SD weights takes minutes)."""
    for name, fragments in _NOT_OURS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(fragments))
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from diffusers.utils import logging as df_logging

        df_logging.disable_progress_bar()
    except ImportError:
        pass


# --- live progress ---------------------------------------------------------------------------------------------------

def clock(seconds: float | None) -> str:
    """0:42, 12:05, 1:02:03; "-" unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "-"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


# What a bar's text may take at 80 columns: the live view draws label, a 24-column bar and the text, a space apart
# (ddpo_tpu/launch/process.py), and labels are at most "epoch NNN" (9).
BAR_TEXT_COLUMNS = 80 - 9 - 1 - 24 - 1


@dataclass
class Bar:
    """One progress line: what it says, how far (None: unknown, a pulsing bar), and its details."""

    label: str
    done: float | None
    total: float | None
    info: str


@dataclass
class ProgressView:
    """The run's progress as the events tell it: the epoch, the phase with its own progress (sampling batches,
    trained timesteps, a compile's elapsed time), rates and ETAs. `feed` takes events as they arrive; `bars` gives
    the lines to draw; `summaries` collects one line per finished epoch (for the console to print once)."""

    num_epochs: int | None = None
    start_epoch: int = 0
    samples_per_batch: int = 0
    batches_per_epoch: int = 0
    train_timesteps: int = 0
    epoch: int | None = None
    epochs_done: int = 0
    phase: str = "starting"              # starting, loaded, sampling, reward, advantages, training, checkpoint, ...
    phase_since: float = 0.0
    done: float | None = None
    total: float | None = None
    updates: int = 0
    epoch_since: float | None = None
    epoch_seconds: list[float] = field(default_factory=list)
    run_since: float | None = None
    compiling: tuple | None = None       # (CompileStart, since, graphs done or None)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    evaluated: str = ""
    saved: bool = False
    summaries: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)

    def feed(self, events: list, now: float | None = None) -> None:
        from ddpo_tpu.rundir import events as ev

        now = time.monotonic() if now is None else now
        for e in events:
            if isinstance(e, ev.RunStart):
                self.num_epochs, self.start_epoch = e.num_epochs, e.start_epoch
                self.samples_per_batch, self.batches_per_epoch = e.samples_per_batch, e.batches_per_epoch
                self.train_timesteps, self.epochs_done = e.train_timesteps, e.start_epoch
                self.run_since = now
                self._phase("loaded", now)
            elif isinstance(e, ev.CompileEnd):
                self.compiling = None
            elif isinstance(e, ev.CompileProgress):
                self.compiling = (e, now - e.seconds, e.compilations)
            elif isinstance(e, ev.CompileStart):
                self.compiling = (e, now, None)
            elif isinstance(e, ev.PhaseStart):
                if e.epoch != self.epoch:
                    self.epoch, self.epoch_since, self.phase_seconds = e.epoch, now, {}
                    self.evaluated, self.saved, self.updates = "", False, 0
                self._phase(e.phase, now)
                if e.phase == "sampling":
                    self.done, self.total = 0, self.batches_per_epoch or None
                elif e.phase == "training":
                    self.done, self.total = 0, None
            elif isinstance(e, ev.SamplingBatch):
                self.done, self.total = e.batch, e.of
            elif isinstance(e, (ev.TrainingProgress, ev.TrainingBatch)):
                self.done, self.total = e.done, e.total
                self.updates = getattr(e, "updates", self.updates)
            elif isinstance(e, ev.PhaseEnd):
                self.phase_seconds[e.phase] = e.seconds
                following = {"sampling": "reward", "reward": "advantages", "training": "checkpoint",
                             "evaluation": "checkpoint"}.get(e.phase)
                if following:
                    self._phase(following, now)
            elif isinstance(e, ev.Evaluated) and e.epoch < 0:  # the frozen policy: a line of its own
                self.summaries.append(f"before training  eval reward {e.mean:.4f} ± {e.std:.4f}")
            elif isinstance(e, ev.Evaluated):
                self.evaluated = f", eval {e.mean:.4f} ± {e.std:.4f}"
            elif isinstance(e, ev.CheckpointSaved):
                self.saved = True
            elif isinstance(e, ev.RunComplete):
                self._phase("complete", now)
            elif isinstance(e, ev.EpochDone):
                self.summaries.append(self.summary(e))
                if self.epoch_since is not None:
                    self.epoch_seconds.append(now - self.epoch_since)
                self.epochs_done, self.epoch_since = e.epoch + 1, None
                self._phase("next" if self.epochs_done < (self.num_epochs or 0) else "finishing", now)

    def _phase(self, phase: str, now: float) -> None:
        self.phase, self.phase_since, self.done, self.total = phase, now, None, None

    def summary(self, e) -> str:
        """One line per finished epoch: its metrics and where its time went."""
        secs = sum(v.get("seconds", 0.0) for v in e.phases.values())
        big = sorted(((k, v.get("seconds", 0.0)) for k, v in e.phases.items()), key=lambda kv: -kv[1])[:2]
        graphs = sum(int(v.get("compilations", 0)) for v in e.phases.values())
        # an algorithm without a PPO ratio (DiffusionNFT) reports no kl or clipfrac: said by leaving them out
        ratio = "".join(f"{name} {fmt.format(v)}  " for name, fmt, v in (("kl", "{:.1e}", e.approx_kl),
                                                                         ("clipfrac", "{:.3f}", e.clipfrac))
                        if math.isfinite(v))
        line = (f"epoch {e.epoch}  reward {e.reward_mean:.4f} ± {e.reward_std:.4f}{self.evaluated}  "
                f"{ratio}{e.updates} updates  {secs:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in big) + ")")
        if graphs:
            line += f"  {graphs} graphs compiled"
        if self.saved:
            line += "  checkpoint saved"
        return line

    def epoch_eta(self, now: float) -> float | None:
        """Seconds to the end of the run: the mean of the finished epochs (the first one, which compiles or warms
        up, left out once there are others) times the epochs left, less what the current epoch has run."""
        if self.num_epochs is None or not self.epoch_seconds:
            return None
        spans = self.epoch_seconds[1:] if len(self.epoch_seconds) > 1 else self.epoch_seconds
        mean = sum(spans) / len(spans)
        left = (self.num_epochs - self.epochs_done) * mean
        if self.epoch_since is not None:
            left -= min(now - self.epoch_since, mean)
        return max(left, 0.0)

    def bars(self, now: float | None = None) -> list[Bar]:
        now = time.monotonic() if now is None else now
        if self.num_epochs is None:  # the training process imports torch and loads the model first
            return [Bar("starting", None, None, f"loading the model and reward  {clock(now - self.created)}")]
        run_elapsed = now - (self.run_since or now)
        out = [Bar("run", self.epochs_done, self.num_epochs,
                   f"{self.epochs_done}/{self.num_epochs} epochs  {clock(run_elapsed)}  "
                   f"ETA {clock(self.epoch_eta(now))}")]
        label = f"epoch {self.epoch if self.epoch is not None else self.epochs_done}"
        elapsed = now - self.phase_since
        if self.compiling is not None:
            start, since, graphs = self.compiling
            # short: the bar's text must fit 80 columns beside its label and bar (BAR_TEXT_COLUMNS)
            text = f"compile {start.stage} {start.index}/{start.of}  {clock(now - since)}"
            if graphs is not None:
                text += f"  {graphs} graphs"
            out.append(Bar(label, None, None, text))
            return out
        if self.phase == "sampling":
            info = f"sampling {self.done or 0}/{self.total or '?'} x {self.samples_per_batch}"
            if self.done:
                info += f"  {self.done * self.samples_per_batch / max(elapsed, 1e-9):.2f}/s"
                info += f"  ETA {clock(elapsed / self.done * ((self.total or 0) - self.done))}"
            else:
                info += f"  {clock(elapsed)}"
            out.append(Bar(label, self.done or 0, self.total, info))
        elif self.phase == "training":
            info = (f"training timesteps {int(self.done)}/{int(self.total)}" if self.total else "training")
            if self.done and self.total:
                info += f"  ETA {clock(elapsed / self.done * (self.total - self.done))}"
            else:
                info += f"  {clock(elapsed)}"
            out.append(Bar(label, self.done or 0, self.total, info))
        else:
            what = {"loaded": "model loaded; the first epoch starts", "reward": "waiting for the rewards",
                    "advantages": "advantages", "checkpoint": "grid, metrics, checkpoint",
                    "next": "the next epoch starts", "finishing": "final weights", "complete": "run complete",
                    }.get(self.phase, self.phase)
            out.append(Bar(label, None, None, f"{what}  {clock(elapsed)}"))
        return out


# event kinds whose console line the live view replaces on a terminal (the view draws them; train.log keeps them)
DRAWN = ("phase_start", "sampling_batch", "training_progress", "compile_start", "compile_progress", "epoch_done",
         "checkpoint", "rewards", "evaluated")


def drawn_lines(event) -> list[str]:
    """The console lines of `event` that the live view stands in for (a non-finite reward's warning is kept)."""
    if event.kind not in DRAWN:
        return []
    text = event.text()
    if not text:
        return []
    lines = text.splitlines()
    return lines[:1] if event.kind == "rewards" else lines


class LineMatcher:
    """The training process's console lines that events stand for: each event's text is written to events.jsonl
    before it is printed, so by the time its line arrives the event is known, and the line is dropped once."""

    def __init__(self):
        self.expected: Counter[str] = Counter()

    def expect(self, events: list) -> None:
        for e in events:
            self.expected.update(drawn_lines(e))

    def take(self, line: str) -> bool:
        if self.expected[line] > 0:
            self.expected[line] -= 1
            return True
        return False
