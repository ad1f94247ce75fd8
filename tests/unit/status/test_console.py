"""What a person sees: the one-screen start, the live progress bars on a terminal (drawn from events.jsonl), the plain
lines when stdout is not a terminal, and no third-party noise. Asserted on events and line counts, not wording."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddpo_tpu.rundir import events as ev
from ddpo_tpu.display.console import LineMatcher, ProgressView, quiet_third_party, start_lines
from tests.helpers import clean_env, run_in_pty

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BAR = "━"  # rich's bar glyph: a progress bar was drawn


def screen_lines(raw: str) -> list[str]:
    """The lines a terminal shows at some point, escape sequences removed (each \\r-overwritten line counts once)."""
    return [line.rstrip("\r").split("\r")[-1] for line in ANSI.sub("", raw).split("\n")]


def lines_before_first_bar(raw: str) -> int:
    text = ANSI.sub("", raw)
    return text[:text.index(BAR)].count("\n") if BAR in text else -1


def epoch_events(num_epochs: int) -> list[ev.Event]:
    out: list[ev.Event] = [ev.RunStart("eager_cpu", num_epochs, 0, 8, 2, 8, "state", False)]
    for e in range(num_epochs):
        out += [ev.PhaseStart(e, "sampling"), ev.SamplingBatch(e, 1, 2), ev.SamplingBatch(e, 2, 2),
                ev.PhaseEnd(e, "sampling", 1.0, 0.5, 0, 0.0), ev.RewardsGathered(e, 0.1 * e, 0.01),
                ev.PhaseStart(e, "training"), ev.TrainingBatch(e, 8, 16, 1), ev.TrainingBatch(e, 16, 16, 2),
                ev.PhaseEnd(e, "training", 2.0, 1.0, 0, 0.0),
                ev.EpochDone(e, 0.1 * e, 0.01, 1e-3, 0.0, 2, {"sampling": {"seconds": 1.0, "compilations": 0},
                                                                "training": {"seconds": 2.0, "compilations": 0}})]
    return out


def test_the_view_tells_epoch_phase_rate_and_eta_from_events():
    view = ProgressView()
    assert view.bars(now=view.created + 3)[0].label == "starting"  # before the first event: loading
    events = epoch_events(3)
    view.feed(events[:1], now=0.0)
    view.feed(events[1:3], now=1.0)  # epoch 0: sampling, 1 of 2 batches after 1 s
    run, phase = view.bars(now=2.0)
    assert (run.done, run.total) == (0, 3) and (phase.done, phase.total) == (1, 2)
    assert "/s" in phase.info and "ETA" in phase.info
    view.feed(events[3:11], now=11.0)  # epoch 0 done after 10 s
    view.feed(events[11:12], now=11.0)
    view.feed(events[12:21], now=17.0)  # epoch 1 done after 6 s
    assert view.epochs_done == 2 and len(view.summaries) == 2
    assert view.epoch_eta(17.0) == pytest.approx(6.0)  # the first epoch (warm-up) is left out of the mean
    view.feed(events[21:28], now=18.0)
    assert view.bars(now=18.0)[1].info.startswith("training timesteps 8/16")
    view.feed(events[28:] + [ev.RunComplete(0, 2, 3)], now=20.0)
    assert len(view.summaries) == 3 and all(f"epoch {e} " in s for e, s in enumerate(view.summaries))


def test_drawn_lines_are_dropped_once_and_others_kept():
    m = LineMatcher()
    m.expect([ev.SamplingBatch(0, 1, 2), ev.RewardsGathered(0, 0.5, 0.1, nonfinite=2), ev.Failed("boom")])
    assert m.take(ev.SamplingBatch(0, 1, 2).text())
    assert not m.take(ev.SamplingBatch(0, 1, 2).text())  # once
    lines = ev.RewardsGathered(0, 0.5, 0.1, nonfinite=2).text().splitlines()
    assert m.take(lines[0]) and not m.take(lines[1])  # a non-finite reward's warning stays on the console
    assert not m.take("error: boom")  # errors are never drawn over


def test_third_party_noise_is_dropped_at_its_logger_only():
    import logging

    quiet_third_party()
    seen: list[str] = []

    class Keep(logging.Handler):  # transformers' loggers do not propagate: a handler of our own on each
        def emit(self, record):
            seen.append(f"{record.name}: {record.getMessage()}")

    noisy, other = (logging.getLogger(n) for n in ("transformers.utils.import_utils", "transformers.modeling_utils"))
    for logger in (noisy, other):
        logger.addHandler(Keep())
    try:
        noisy.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to `X`")
        noisy.warning("something else about the run")
        other.warning("requires torchvision (not installed); falling back to")
    finally:
        for logger in (noisy, other):
            logger.handlers = [h for h in logger.handlers if not isinstance(h, Keep)]
    assert seen == ["transformers.utils.import_utils: something else about the run",
                    "transformers.modeling_utils: requires torchvision (not installed); falling back to"]


def test_torch_compile_notes_on_the_distributed_execution_are_dropped_at_their_loggers():
    import logging

    quiet_third_party()
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    # the loggers and texts as torch 2.9 emits them (torch/_dynamo/variables/torch.py: warning_once(log, "Profiler
    # function %s will be ignored", ...); torch/utils/cpp_extension.py: "No CUDA runtime is found, using CUDA_HOME=")
    dynamo, cpp = logging.getLogger("torch._dynamo.variables.torch"), logging.getLogger("torch.utils.cpp_extension")
    for logger in (dynamo, cpp):
        logger.addHandler(Keep())
    try:
        dynamo.warning("Profiler function %s will be ignored", "<class 'torch.autograd.profiler.record_function'>")
        cpp.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local'")
        dynamo.warning("Graph break from `Tensor.item()`")
    finally:
        for logger in (dynamo, cpp):
            logger.handlers = [h for h in logger.handlers if not isinstance(h, Keep)]
    assert seen == ["Graph break from `Tensor.item()`"]


def test_gloo_prints_reach_train_log_but_not_the_console(tmp_path, capfd):
    """gloo prints its connection count with std::cout (no logger): the front end keeps it in train.log only."""
    import sys

    from ddpo_tpu.display.console import third_party_line
    from ddpo_tpu.launch.process import run_training

    gloo = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    assert third_party_line(gloo.encode() + b"\n") and not third_party_line(b"[epoch 0] sampling start\n")
    script = (f"print({gloo!r}); print('ddpo_tpu: ours'); "
              "print('[Gloo] Rank 1 is connected to 0 peer ranks.', flush=True)")
    log = tmp_path / "train.log"
    code = run_training(dict(__import__("os").environ), log, cmd=[sys.executable, "-c", script])
    out = capfd.readouterr().out
    assert code == 0 and "ddpo_tpu: ours" in out and "[Gloo]" not in out
    assert log.read_text().count("[Gloo] ") == 2


def test_the_start_is_a_few_lines_with_the_parity_verdict(tmp_path):
    from ddpo_tpu.config.compose import compose_and_validate

    rows = dict(start_lines(compose_and_validate(["+experiment=smoke"]), tmp_path))
    assert {"run dir", "model", "algorithm", "reward", "topology", "parity", "config"} <= set(rows)
    assert len(rows) <= 12 and "config.yaml" in rows["config"]
    parity = dict(start_lines(compose_and_validate(["+experiment=compressibility_parity"]), tmp_path))["parity"]
    assert "ddpo_pytorch_compressibility" in parity and "hold" in parity
    # the sampler line names the sampler's own noise key: DDIM's eta, the flow SDE's noise level (never "eta None")
    assert "eta 1.0" in rows["sampler"] and "noise level" not in rows["sampler"]
    flow = dict(start_lines(compose_and_validate(["+experiment=flow_grpo_smoke"]), tmp_path))["sampler"]
    assert "noise level 0.7" in flow and "eta" not in flow


FAKE_WORKER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from ddpo_tpu.rundir import events as ev
    # a stand-in for ddpo_tpu.worker: the events of a 3-epoch run, written and printed by the real EventLog
    log = ev.EventLog(Path(os.environ["FAKE_RUN_DIR"]))
    print("some line of the training process", flush=True)
    for e in (%s):
        log.emit(e)
        time.sleep(0.01)
""")


def _front_end(tmp_path: Path) -> tuple[list[str], dict]:
    from tests.unit.status import test_console

    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    events = "[" + ", ".join(f"ev.{e!r}" for e in epoch_events(3)) + ", ev.RunComplete()]"
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER % events)
    code = ("import sys; from pathlib import Path; from ddpo_tpu.launch import process; "
            "process.WORKER_MODULE = 'fake_worker'; process._LiveStatus.POLL_S = 0.05; "
            "sys.exit(process.run_training(dict(__import__('os').environ), Path(sys.argv[1]) / 'train.log'))")
    assert test_console
    env = clean_env(FAKE_RUN_DIR=str(run_dir))
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    return [sys.executable, "-c", code, str(run_dir)], env


def test_a_terminal_gets_bars_and_a_summary_per_epoch_a_pipe_gets_plain_lines(tmp_path, monkeypatch, capfd):
    """The terminal in a real front-end process (what proves its exit code and console on a pseudo-terminal); the
    pipe calls the same run_training in this process, its stdout captured (not a terminal, as `| cat`): the same
    code, with the fake worker still its own process, where only the front end's process start differs."""
    cmd, env = _front_end(tmp_path)
    code, raw = run_in_pty(cmd, tmp_path, env, timeout=60)
    assert code == 0, raw
    shown = screen_lines(raw)
    assert BAR in raw and 0 <= lines_before_first_bar(raw) <= 25
    assert sum(1 for line in shown if re.match(r"epoch \d+  reward", line)) == 3  # one summary line per epoch
    assert not any("sampling batch" in line for line in shown)  # drawn as a bar, not printed
    assert any("some line of the training process" in line for line in shown)
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("sampling batch") == 6  # train.log keeps every line

    (tmp_path / "run" / "train.log").unlink()
    from ddpo_tpu.launch import process

    monkeypatch.setattr(process, "WORKER_MODULE", "fake_worker")  # what _front_end's command sets
    monkeypatch.setattr(process._LiveStatus, "POLL_S", 0.05)
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    code = process.run_training(env, tmp_path / "run" / "train.log")  # `| cat`
    piped = capfd.readouterr()
    assert code == 0, piped.out + piped.err
    assert "\x1b[" not in piped.out and BAR not in piped.out
    assert piped.out.count("sampling batch") == 6 and piped.out.count("] done: reward") == 3


@pytest.mark.needs_torch
@pytest.mark.slow  # two smoke runs of 1 epoch on the tiny model
def test_a_smoke_run_on_a_terminal_and_through_a_pipe(tmp_path, model_cache):
    """The real front end and training process: at most ~25 lines before the first bar, no third-party warning or
    progress bar of another library, the epoch's summary line once; through a pipe, the plain lines of the events.
    One epoch: the count of summary and done lines over several epochs is the in-process test's above (3 epochs)."""
    args = ["+experiment=smoke", "num_epochs=1", f"model.cache_dir={model_cache}"]
    code, raw = run_in_pty([sys.executable, "-m", "ddpo_tpu.train", *args, "run_name=tty"], tmp_path, clean_env(),
                           timeout=600)
    assert code == 0, raw[-3000:]
    shown = screen_lines(raw)
    assert BAR in raw and 0 <= lines_before_first_bar(raw) <= 25, lines_before_first_bar(raw)
    assert sum(1 for line in shown if re.match(r"epoch \d+  reward", line)) == 1
    for noise in ("[transformers]", "Warning", "warn", "Loading weights", "it/s]"):
        assert not any(noise in line for line in shown), noise
    kinds = [r["event"] for r in ev.read_events(tmp_path / "outputs" / "tty")]
    assert kinds.count("epoch_done") == 1 and kinds.count("training_batch") >= 2

    r = subprocess.run([sys.executable, "-m", "ddpo_tpu.train", *args, "run_name=pipe"], cwd=tmp_path,
                       env=clean_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout and BAR not in r.stdout
    assert r.stdout.count("] done: reward") == 1 and "[epoch 0] sampling batch 2/2 done" in r.stdout
    assert "[transformers]" not in r.stdout + r.stderr
    assert (tmp_path / "outputs" / "pipe" / "reward_curve.png").is_file()


def test_every_bar_fits_an_80_column_terminal():
    """The live view draws label, a 24-column bar and the text: at 80 columns nothing may be cut (rich cuts the
    last column). States with long numbers: 3-digit epochs, hours on the clocks, a compile with its graph count."""
    from ddpo_tpu.display.console import BAR_TEXT_COLUMNS

    view = ProgressView()
    texts = [f"{b.label} {b.info}" for b in view.bars(now=view.created + 3600)]
    view.feed([ev.RunStart("distributed", 999, 0, 128, 16, 128, "state", True)], now=0.0)
    states = [[ev.PhaseStart(998, "sampling"), ev.CompileStart(998, "evaluation", 12, 12)],
              [ev.CompileProgress(998, "evaluation", 12, 12, 3000.0, 123, 10.0)],
              [ev.CompileEnd(998, "evaluation", 12, 12, 3001.0, 123, 10.0), ev.SamplingBatch(998, 15, 16)],
              [ev.PhaseStart(998, "training")], [ev.TrainingBatch(998, 1000, 1600, 30)],
              [ev.PhaseEnd(998, "training", 9999.0, 1.0, 0, 0.0)], [ev.PhaseStart(998, "evaluation")]]
    for i, batch in enumerate(states):
        view.feed(batch, now=10.0 + i)
        texts += [f"{b.label} {b.info}" for b in view.bars(now=3600.0 + i)]  # an hour on the clocks
    assert len(texts) == 1 + 2 * len(states)
    for text in texts:
        label, info = ("epoch " + text[6:].split(" ", 1)[0], text[6:].split(" ", 1)[1]) \
            if text.startswith("epoch ") else text.split(" ", 1)
        assert len(label) <= 9 and len(info) <= BAR_TEXT_COLUMNS, (len(info), info)


def test_an_epoch_without_a_ratio_leaves_kl_and_clipfrac_out_of_its_line():
    view = ProgressView()
    view.feed([ev.RunStart("eager_cpu", 2, 0, 8, 2, 8, "state", False)], now=0.0)
    view.feed([ev.EpochDone(0, 0.5, 0.1, float("nan"), float("nan"), 2, {"training": {"seconds": 1.0}}),
               ev.EpochDone(1, 0.5, 0.1, 1e-3, 0.25, 2, {"training": {"seconds": 1.0}})], now=1.0)
    nft, ddpo = view.summaries
    assert "nan" not in nft and "kl" not in nft and "clipfrac" not in nft and "2 updates" in nft
    assert "kl 1.0e-03  clipfrac 0.250  2 updates" in ddpo
