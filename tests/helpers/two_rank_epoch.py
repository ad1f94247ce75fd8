"""One epoch of the smoke on two gloo ranks, both ways of holding its samples (run under torchrun by
tests/e2e/test_distributed.py; writes rank<N>.json into the directory it is given).

Each rank samples the epoch once, then builds the training samples twice from the same rewards: with
distributed.keep_samples_on_rank (its own samples) and as the default (the whole epoch gathered), counting the bytes
the runtime's gathers produce for each; then trains one epoch on its own samples. What it writes is raw: the test
judges it."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.rundir.files import RunDir
from ddpo_tpu.runtime import make_runtime
from ddpo_tpu.training import loop
from ddpo_tpu.training.epoch_data import drawn_rows


def tensors(s) -> list[torch.Tensor]:
    return [s.latents, s.log_probs, s.step_indices, *s.cond]


def main(out: Path, model_cache: str) -> None:
    v = compose_and_validate(["+experiment=smoke", "tpu_topology=cpu_dist2", "distributed.compile=none",
                              "distributed.keep_samples_on_rank=true", f"model.cache_dir={model_cache}",
                              "sample.batch_size=2", "train.batch_size=1", "reward.host_workers=0"])
    rt = make_runtime(v.cfg)
    (out / "run").mkdir(exist_ok=True)
    tr = loop.Trainer(v.cfg, rt, RunDir(out / "run"), tree=v.tree, stop=SimpleNamespace(requested=False))
    sampled = tr.sample_epoch(0)
    rewards = tr.gather_rewards(0, sampled)
    algorithm = copy.deepcopy(tr.algorithm)  # the stat tracker takes each epoch's rewards once: both modes start here
    c0 = rt.counters().gathered_bytes
    own = tr.epoch_samples(0, sampled, rewards)
    c1 = rt.counters().gathered_bytes
    tr.algorithm, tr.keep_samples_on_rank = algorithm, False
    whole = tr.epoch_samples(0, sampled, rewards)
    c2 = rt.counters().gathered_bytes
    rows = torch.as_tensor(drawn_rows(rt, len(sampled.trajectories), tr.global_batch))
    picked = lambda x: x.index_select(0, rows)  # noqa: E731
    before = [p.detach().clone() for p in tr.state.params]
    tr.report.tracker = SimpleNamespace(log=lambda *a, **k: None)
    logs = tr.train_epoch(0, own)
    after = torch.cat([p.detach().reshape(-1) for p in tr.state.params])
    peers = [torch.empty_like(after) for _ in range(rt.process_count)]
    dist.all_gather(peers, after)
    result = {
        "rank": rt.process_index, "own_samples": int(own.advantages.shape[0]),
        "whole_samples": int(whole.advantages.shape[0]),
        "gathered_bytes_own": c1 - c0, "gathered_bytes_whole": c2 - c1,
        "bytes_held_own": sum(t.numel() * t.element_size() for t in tensors(own)),
        "bytes_held_whole": sum(t.numel() * t.element_size() for t in tensors(whole)),
        "own_rows": own.own_rows, "whole_rows": whole.own_rows,
        # the samples and advantages this rank trains vs the whole epoch's at the rows it drew
        "advantages_differ": float((own.advantages - picked(whole.advantages)).abs().max()),
        "weights_differ": float((own.weights - picked(whole.weights)).abs().max()),
        "trajectories_differ": max(float((a.float() - picked(b).float()).abs().max())
                                   for a, b in zip(tensors(own), tensors(whole))),
        "advantages_std": float(own.advantages.std()),
        "updates": len(logs), "grad_norms": [r["grad_norm"] for r in logs],
        "weight_change": float(torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(tr.state.params, before)])
                               .norm() / torch.cat([b.reshape(-1) for b in before]).norm()),
        "ranks_differ": max(float((p - after).abs().max()) for p in peers),
    }
    (out / f"rank{rt.process_index}.json").write_text(json.dumps(result))
    rt.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
