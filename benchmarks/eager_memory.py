"""What one eager forward + backward keeps for the backward, measured two ways; the shared part of the activation
probes (benchmarks/probes/sd14_activations.py, sd3_activations.py). Run in a process of its own per measurement
(runner.run_child), with MALLOC_MMAP_THRESHOLD_ set low (EAGER_ENV) so freed tensors leave the resident memory."""

from __future__ import annotations

import time

from benchmarks import runner

EAGER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # big blocks from mmap: freed memory leaves the RSS


def random_weights(model, dtype):
    """A model built on the meta device, materialised on the CPU with N(0, 0.02) values (the initialisers' cost
    saved: the values do not matter for memory), frozen, eval mode."""
    import torch

    model = model.to_empty(device="cpu").to(dtype).eval().requires_grad_(False)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.normal_(0.0, 0.02)
    return model


def measure_backward(model, forward, precision: str, warmup: bool) -> dict:
    """What one forward + backward of `forward()` (-> output tensor) keeps for the backward, eager CPU. Two
    accountings: the bytes of the distinct storages autograd saves (saved_tensors_hooks, weights and buffers excluded;
    blind inside checkpointed blocks, whose own hooks take over) and the process's peak resident memory over the step
    (VmHWM, reset just before) minus the resident memory before it."""
    import contextlib
    import gc

    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: dict[int, int] = {}
    squares = []

    def pack(tensor):
        st = tensor.untyped_storage()
        if st.data_ptr() not in weights:
            saved[st.data_ptr()] = st.nbytes()
            if tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] and tensor.shape[-1] >= 1024:
                squares.append(tuple(tensor.shape))
        return tensor

    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())

    def step(hooks: bool):
        with autocast, (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if hooks
                        else contextlib.nullcontext()):
            out = forward()
        return out.float().square().mean()

    if warmup:
        step(False).backward()  # LoRA gradients, kernels' scratch
    gc.collect()
    before = runner.vm_bytes("VmRSS")
    runner.reset_peak_rss()
    t0 = time.perf_counter()
    loss = step(True)
    after_forward = runner.vm_bytes("VmRSS")
    loss.backward()
    peak = runner.vm_bytes("VmHWM")
    G = 2 ** 30
    return {"saved_gib": round(sum(saved.values()) / G, 4),
            "rss_after_forward_gib": round((after_forward - before) / G, 4),
            "peak_rss_delta_gib": round((peak - before) / G, 4), "score_matrices_saved": len(squares),
            "seconds": round(time.perf_counter() - t0, 1)}
