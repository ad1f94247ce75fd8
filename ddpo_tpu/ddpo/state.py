"""The training state: the trained parameters' optimizer, gradients and placement on the devices, and the step
counter. It owns what a checkpoint holds of it (state_dict / load_state_dict, host copies), as torchtitan's
Stateful components do; the trained weights themselves belong to the model family."""

from __future__ import annotations

from typing import Any

import torch

from ddpo_tpu.runtime import Runtime
from ddpo_tpu.runtime.base import StateLayout


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
                                            "exp_avg": torch.zeros(p.shape, dtype=p.dtype).to(rt.device),
                                            "exp_avg_sq": torch.zeros(p.shape, dtype=p.dtype).to(rt.device)}
            # gradients too (backward accumulates into them, zero_grad zeroes them in place): one layout for the
            # first micro-step and every later one. (A trainable weight no loss reaches would now get AdamW's weight
            # decay where a None gradient skipped it; LoRA and the UNet reach every one.)
            p.grad = torch.zeros(p.shape, dtype=p.dtype).to(rt.device)
            rt.place_state([p.grad, st["exp_avg"], st["exp_avg_sq"]])
        self.global_step = 0

    def update(self, max_grad_norm: float) -> torch.Tensor:
        """Clip the accumulated gradients, step the optimizer, zero the gradients in place; the norm (device)."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm)
        self.rt.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=False)
        self.global_step += 1
        return norm

    def layout(self) -> StateLayout:
        return self.rt.state_layout([*self._model.parameters(), *(p.grad for p in self.params),
                                     *(t for st in self.optimizer.state.values() for t in st.values())])

    def parameter_bytes(self) -> int:
        return sum(p.numel() * 4 for p in self.params)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state with host copies of its tensors (one sync, then plain copies)."""
        opt = self.optimizer.state_dict()
        flat = {f"{k}/{n}": t for k, v in opt["state"].items() for n, t in v.items() if torch.is_tensor(t)}
        host = self.rt.state_to_host(flat)
        opt["state"] = {k: {n: host.get(f"{k}/{n}", t) for n, t in v.items()} for k, v in opt["state"].items()}
        return opt

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A saved AdamW state, one parameter at a time: each moment uploaded, cast as load_state_dict would, and
        placed as it arrives (load_state_dict would upload them all replicated beside the fresh ones). The loaded
        weights are pinned to their layout again too (copy_ into an XLA tensor drops its sharding)."""
        self.rt.place_state(self.params)
        self.optimizer.load_state_dict({**saved, "state": {}})  # the groups' hyperparameters; drops the fresh state
        ids = [i for group in saved["param_groups"] for i in group["params"]]
        for i, p in zip(ids, self.params, strict=True):
            st = saved["state"][i]
            moments = {k: st[k].to(dtype=p.dtype).to(self.rt.device) for k in ("exp_avg", "exp_avg_sq")}
            self.optimizer.state[p] = {"step": st["step"].to(torch.float32), **moments}
            self.rt.place_state(moments.values())
