"""Rewards off the critical path (training/reward_overlap.py, issue 41 item 4): the reward calls' own seconds and the
part of them sampling hid, through the loop's own `_score` and `gather_rewards`; each pool thread's CUDA stream (with a
stand-in torch.cuda: no GPU needed); the fields in the epoch's event and its console line."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import torch

from ddpo_tpu.rundir import events as ev
from ddpo_tpu.runtime.base import Counters
from ddpo_tpu.status.facts import host_time, throughput
from ddpo_tpu.training import loop
from ddpo_tpu.training.reporting import PhaseClock, Reporter
from ddpo_tpu.training.reward_overlap import RewardTiming

CALL_S = 0.15  # one reward call's sleep


def stand_in(pool, emitted: list):
    """What Trainer._score and Trainer.gather_rewards read of the Trainer, with a reward that sleeps CALL_S."""
    def reward(images, prompts):
        time.sleep(CALL_S)
        return np.arange(len(prompts), dtype=np.float32)

    cfg = SimpleNamespace(reward=SimpleNamespace(name="sleepy"), xla=SimpleNamespace(sync_before_reward_gather=False),
                          on_nonfinite_reward="stop")
    return SimpleNamespace(cfg=cfg, prompts=SimpleNamespace(metadata=lambda p: None), reward=reward, image_scores=None,
                           pool=pool, reward_bound_s=0.0, rt=SimpleNamespace(gather_rows=lambda x: x),
                           gdpo_weights=None, events=SimpleNamespace(emit=emitted.append),
                           reward_timing=RewardTiming(torch.device("cpu"), pooled=pool is not None))


def sample_and_gather(t, batches: int, sampling_s: float) -> np.ndarray:
    """The loop's order: each batch's images scored (`_score`) after it samples (a sleep of `sampling_s`), then the
    epoch's rewards gathered."""
    images = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    pending = []
    for _ in range(batches):
        time.sleep(sampling_s)
        pending.append(loop.Trainer._score(t, images, ["a", "b"]))
    return loop.Trainer.gather_rewards(t, 0, SimpleNamespace(pending_rewards=pending))


def test_a_pools_scoring_while_the_next_batch_samples_is_hidden():
    """One worker: batch 1 is scored while batch 2 "samples", batch 2 while the loop sleeps before gathering: both
    calls' seconds are scored and nearly all hidden (the loop waits only for what was still running)."""
    emitted: list = []
    with ThreadPoolExecutor(1) as pool:
        t = stand_in(pool, emitted)
        images = np.zeros((2, 4, 4, 3), dtype=np.uint8)
        pending = [loop.Trainer._score(t, images, ["a", "b"])]
        time.sleep(CALL_S + 0.05)  # the next batch samples
        pending.append(loop.Trainer._score(t, images, ["a", "b"]))
        time.sleep(CALL_S + 0.05)
        rewards = loop.Trainer.gather_rewards(t, 0, SimpleNamespace(pending_rewards=pending))
    assert list(rewards) == [0.0, 1.0, 0.0, 1.0] and isinstance(emitted[-1], ev.RewardsGathered)
    fields = t.reward_timing.take()
    assert 2 * CALL_S <= fields["scored_seconds"] < 2 * CALL_S + 0.5
    assert fields["scored_seconds"] - 0.1 <= fields["hidden_seconds"] <= fields["scored_seconds"]
    assert t.reward_timing.take() == {"scored_seconds": 0.0, "hidden_seconds": 0.0}  # the next epoch counts anew


def test_a_pools_scoring_the_loop_waits_for_is_not_hidden():
    """Gathered at once after the one batch: the loop waits for the whole call, so next to nothing is hidden."""
    with ThreadPoolExecutor(1) as pool:
        t = stand_in(pool, [])
        sample_and_gather(t, batches=1, sampling_s=0.0)
    fields = t.reward_timing.take()
    assert fields["scored_seconds"] >= CALL_S and fields["hidden_seconds"] < 0.05


def test_inline_scoring_is_scored_and_never_hidden():
    """reward.host_workers=0: each call holds the main thread between two batches; nothing runs beside sampling."""
    t = stand_in(None, [])
    sample_and_gather(t, batches=2, sampling_s=0.0)
    fields = t.reward_timing.take()
    assert fields["scored_seconds"] >= 2 * CALL_S and fields["hidden_seconds"] == 0.0


class FakeCuda:
    """torch.cuda's stream calls, recorded per thread (no GPU): Stream, and stream(s) making s the current one."""

    def __init__(self):
        self.made, self.log, self.local = [], [], threading.local()
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.device, self.thread, self.waited = device, threading.get_ident(), []
                fake.made.append(self)

            def wait_stream(self, other):
                self.waited.append(other)

            def synchronize(self):
                fake.log.append(("synchronize", self))

        self.Stream = Stream

    def stream(self, s):
        import contextlib

        @contextlib.contextmanager
        def current():
            before, self.local.current = getattr(self.local, "current", None), s
            try:
                yield
            finally:
                self.local.current = before

        return current()

    def install(self, monkeypatch):
        for name in ("Stream", "stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self


def test_on_cuda_each_pool_thread_scores_on_a_stream_of_its_own(monkeypatch):
    """Two workers, four calls: two streams, each made in (and reused by) its thread and waiting for no other
    stream (the inputs are host arrays); every call runs with its thread's stream current and synchronizes it before
    its values return."""
    cuda = FakeCuda().install(monkeypatch)
    timing = RewardTiming(torch.device("cuda", 0), pooled=True)
    both = threading.Barrier(2)

    def reward(i):
        both.wait(timeout=5)  # both threads take a call
        s = cuda.local.current
        cuda.log.append(("scored", s))
        return s, threading.get_ident()

    with ThreadPoolExecutor(2) as pool:
        seen = [f.result() for f in [pool.submit(timing.timed(reward), i) for i in range(4)]]
    assert len(cuda.made) == 2 and {s.thread for s in cuda.made} == {tid for _, tid in seen}
    assert all(s.device == torch.device("cuda", 0) and s.waited == [] for s in cuda.made)
    assert all(s is not None and s.thread == tid for s, tid in seen)  # a thread's calls on its own stream
    for s in cuda.made:  # each call's sync follows its scoring, on the same stream
        mine = [kind for kind, x in cuda.log if x is s]
        assert mine == ["scored", "synchronize"] * (len(mine) // 2) and mine
    assert getattr(cuda.local, "current", None) is None  # the main thread's stream untouched


def test_inline_cuda_scoring_and_the_cpu_keep_the_current_stream(monkeypatch):
    """No stream is made or made current for inline scoring on CUDA, nor for a pool on the CPU or XLA."""
    cuda = FakeCuda().install(monkeypatch)
    current = lambda: getattr(cuda.local, "current", None)
    assert RewardTiming(torch.device("cuda", 0), pooled=False).timed(current)() is None
    with ThreadPoolExecutor(1) as pool:
        for device in (torch.device("cpu"), None, SimpleNamespace(type="xla")):
            assert pool.submit(RewardTiming(device, pooled=True).timed(current)).result() is None
    assert cuda.made == [] and cuda.log == []


class FakeRt:
    def counters(self) -> Counters:
        return Counters()


def test_the_reward_phase_carries_scored_and_hidden_seconds_to_the_event_and_the_line(tmp_path):
    """The loop's PhaseClock record of "reward", with the timing's fields, goes whole into epoch_done (events.jsonl)
    and says them on the epoch's console line; status/facts.py reads the epoch's seconds as before."""
    clock = PhaseClock(FakeRt())
    with clock.measure("sampling"):
        pass
    with clock.measure("reward"):
        pass
    clock.phases["reward"].update({"scored_seconds": 1.94, "hidden_seconds": 1.81})
    log = ev.EventLog(tmp_path)
    Reporter(None, SimpleNamespace(is_main=True), None, log, {}, ()).epoch_done(
        0, np.array([0.5, 0.5]), [{"approx_kl": 0.0, "clipfrac": 0.0}], clock)
    rec = [json.loads(line) for line in (tmp_path / ev.EVENTS_FILE).read_text().splitlines()][-1]
    assert rec["event"] == "epoch_done"
    assert rec["phases"]["reward"]["scored_seconds"] == 1.94 and rec["phases"]["reward"]["hidden_seconds"] == 1.81
    line = ev.EpochDone(**{k: v for k, v in rec.items() if k not in ("time", "pid", "event")}).text()
    assert line.endswith("sampling 0.0s/0c, reward 0.0s/0c (1.9s scored, 1.8s hidden)")
    plain = ev.EpochDone(0, 0.5, 0.0, 0.0, 0.0, 1, {"reward": {"seconds": 0.1, "compilations": 0}}).text()
    assert plain.endswith("reward 0.1s/0c")  # a record without the fields (older runs) reads as before
    epoch = {"epoch": 0, "num_samples": 2,
             "phases": {**clock.phases, "training": {"seconds": 2.0, "host_seconds": 1.0}}}
    assert throughput([epoch])[1] == sum(p["seconds"] for p in epoch["phases"].values())  # scored is not wall time
    assert set(host_time([epoch]).phases) == {"sampling", "reward", "training"}
