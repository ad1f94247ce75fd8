"""The training state: the trained parameters' optimizer, gradients and placement on the devices, the step
counter and an optional EMA of the trained weights. It owns what a checkpoint holds of it (state_dict /
load_state_dict, host copies), as torchtitan's Stateful components do; the trained weights themselves belong to the
model family."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ddpo_tpu.runtime import Runtime
from ddpo_tpu.runtime.base import StateLayout


class EMA:
    """An exponential moving average of the trained weights, as flow_grpo keeps one for evaluation and for the
    weights it saves: after every train batch, when (step + 1) is a multiple of `every` (step: optimizer steps done
    so far), shadow += (1 - d) (weights - shadow) with d = min((1 + step) / (10 + step), decay).

    The update runs after every train batch with a weight of 0 between updates (shadow + 0 (w - shadow) is shadow
    exactly), so on XLA it is one graph from the first batch on, never a new one when the first real update comes
    in a later epoch."""

    def __init__(self, params: list[torch.Tensor], decay: float, every: int, rt: Runtime):
        self.params, self.decay, self.every, self.rt = params, decay, every, rt
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in params]
        rt.place_state(self.shadow)
        rt.sync()

    def weight(self, step: int) -> float:
        """1 - d at this step, or 0 when the step does not update."""
        if (step + 1) % self.every:
            return 0.0
        return 1.0 - min((1 + step) / (10 + step), self.decay)

    @torch.no_grad()
    def update(self, step: int) -> None:
        w = torch.tensor(self.weight(step), dtype=torch.float32).to(self.rt.device)  # data, not a graph constant
        for e, p in zip(self.shadow, self.params):
            e.add_(w * (p.detach() - e))
        self.rt.sync()

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holds the average inside the block and its trained weights again after it. The tensors are
        exchanged, not copied: no device work, and no copy that would change the next update's graph on XLA
        (measured: in-place copies made the EMA update compile again in the epoch after an evaluation). Under SPMD
        the update after the first exchange still compiles once more (one small graph, measured on 4 CPU devices;
        cause not found), then never again."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    def _exchange(self) -> None:
        from torch.distributed.tensor import DTensor

        for p, e in zip(self.params, self.shadow):
            if isinstance(p, DTensor):  # FSDP2 gathers from its own storage of the shard: exchange the values in it
                with torch.no_grad():
                    held = p.detach().clone()
                    p.detach().copy_(e)
                    e.copy_(held)
            else:
                p.data, e.data = e.data, p.data

    def load(self, saved: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for e, t in zip(self.shadow, saved, strict=True):
                e.copy_(self.rt.place_like(t, e))
        self.rt.place_state(self.shadow)

    def reset(self) -> None:
        """Start the average at the current weights (a resume from a checkpoint that has none)."""
        with torch.no_grad():
            for e, p in zip(self.shadow, self.params):
                e.copy_(p.detach())
        self.rt.place_state(self.shadow)
        self.rt.sync()


class TrainState:
    def __init__(self, model: torch.nn.Module, train_cfg, rt: Runtime):
        self.rt = rt
        # after the model moved to the device: moving to an XLA device may replace the Parameter objects
        self.params = [p for p in model.parameters() if p.requires_grad]
        t = train_cfg
        self.optimizer = torch.optim.AdamW(self.params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                                           weight_decay=t.adam_weight_decay, eps=t.adam_epsilon)
        # every weight (frozen ones too) replicated or split on the fsdp axis; then each gradient and moment
        # placed as it is made, so under fsdp they are never whole on a device
        rt.place_state(model.parameters())
        self._model = model
        # AdamW's state as its first step would create it (step on the host, zero moments), but uploaded as data:
        # created lazily inside the first step it would make that step a graph of its own, compiled again at the
        # second step (in epoch 1 when an epoch has a single update)
        for p in self.params:
            st = self.optimizer.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                            "exp_avg": rt.zeros_like_state(p), "exp_avg_sq": rt.zeros_like_state(p)}
            # gradients too (backward accumulates into them, zero_grad zeroes them in place): one layout for the
            # first micro-step and every later one. (A trainable weight no loss reaches would now get AdamW's weight
            # decay where a None gradient skipped it; LoRA and the UNet reach every one.)
            p.grad = rt.zeros_like_state(p)
            rt.place_state([p.grad, st["exp_avg"], st["exp_avg_sq"]])
        self.global_step = 0
        self.ema = EMA(self.params, t.ema_decay, t.ema_every, rt) if t.ema else None
        # other copies of the trained weights an algorithm keeps (DiffusionNFT's old policy), checkpointed beside EMA
        self.copies: dict[str, EMA] = {}

    def update(self, max_grad_norm: float) -> torch.Tensor:
        """Clip the accumulated gradients, step the optimizer, zero the gradients in place; the norm (device)."""
        norm = self.rt.to_full(torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm))  # FSDP2: a DTensor
        self.rt.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=False)
        self.global_step += 1
        return norm

    def end_batch(self) -> None:
        """After every train batch (flow_grpo's EMA step)."""
        if self.ema is not None:
            self.ema.update(self.global_step)

    def ema_weights(self):
        """A context in which the model holds the EMA of its trained weights (evaluation, the final EMA weights);
        the trained weights themselves when there is no EMA."""
        return self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()

    def layout(self) -> StateLayout:
        return self.rt.state_layout([*self._model.parameters(), *(p.grad for p in self.params),
                                     *(t for st in self.optimizer.state.values() for t in st.values())])

    def parameter_bytes(self) -> int:
        return sum(p.numel() * 4 for p in self.params)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state with host copies of its tensors (one sync, then plain copies), and the EMA's
        weights (in parameter order) under "ema" when there is one."""
        opt = self.optimizer.state_dict()
        flat = {f"{k}/{n}": t for k, v in opt["state"].items() for n, t in v.items() if torch.is_tensor(t)}
        if self.ema is not None:
            flat.update({f"ema/{i}": t for i, t in enumerate(self.ema.shadow)})
        for name, copy in self.copies.items():
            flat.update({f"{name}/{i}": t for i, t in enumerate(copy.shadow)})
        host = self.rt.state_to_host(flat)
        opt["state"] = {k: {n: host.get(f"{k}/{n}", t) for n, t in v.items()} for k, v in opt["state"].items()}
        if self.ema is not None:
            opt["ema"] = [host[f"ema/{i}"] for i in range(len(self.ema.shadow))]
        for name, copy in self.copies.items():
            opt[name] = [host[f"{name}/{i}"] for i in range(len(copy.shadow))]
        return opt

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A saved AdamW state, one parameter at a time: each moment uploaded, cast as load_state_dict would, and
        placed as it arrives (load_state_dict would upload them all replicated beside the fresh ones). The loaded
        weights are pinned to their layout again too (copy_ into an XLA tensor drops its sharding)."""
        self.rt.place_state(self.params)
        saved = dict(saved)
        ema = saved.pop("ema", None)
        copies = {name: saved.pop(name, None) for name in self.copies}
        self.optimizer.load_state_dict({**saved, "state": {}})  # the groups' hyperparameters; drops the fresh state
        ids = [i for group in saved["param_groups"] for i in group["params"]]
        for i, p in zip(ids, self.params, strict=True):
            st = saved["state"][i]
            moments = {k: self.rt.place_like(st[k], p) for k in ("exp_avg", "exp_avg_sq")}
            self.optimizer.state[p] = {"step": st["step"].to(torch.float32), **moments}
            self.rt.place_state(moments.values())
        if self.ema is not None and ema is None:  # train.ema turned on for a run saved without one
            self.ema.reset()
        elif self.ema is not None:
            with torch.no_grad():
                for e, t in zip(self.ema.shadow, ema, strict=True):
                    e.copy_(self.rt.place_like(t, e))
            self.rt.place_state(self.ema.shadow)
        for name, copy in self.copies.items():  # saved without it: start at the loaded weights
            copy.reset() if copies[name] is None else copy.load(copies[name])
