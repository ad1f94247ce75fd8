"""Guards against reward over-optimisation that GRPO takes as options: GARDO's adaptive KL reference (GRPO-Guard's
RatioNorm is a loss, ratio_norm_loss in grpo.py)."""

from __future__ import annotations

from typing import Any


class AdaptiveReference:
    """GARDO's adaptive KL reference (yifan123/flow_grpo@94e23ee5405ab7241fc1f75d30cac8147e2b1f53,
    scripts/train_sd3_gardo.py, cited by statement: the store serves that commit's text, not a checkout to number):
    an "old" copy of the trained weights, equal to them at the start (the copy loop before `while True`), that the
    KL compares with (`transformer.module.set_adapter("old")` around the reference's compute_log_prob) in place of
    the adapter-off base model; reset to the current weights after an epoch's sampling (`if (epoch !=0 and
    reset==True) or (epoch - prev_epoch)>config.reset_freq`) when an update of the previous epoch logged a KL above
    `threshold` (`if info["kl_loss"] > thres: reset=True`, config.kl_thres) or more than `every` epochs passed since
    the last reset (config.reset_freq). Only with a KL term (`if config.train.beta>0`)."""

    NAME = "gardo_reference"   # its name in TrainState.copies (checkpointed with the optimizer)

    def __init__(self, threshold: float, every: int):
        self.threshold, self.every = threshold, every
        self.flagged, self.last = False, 0
        self.copy = None

    def attach(self, trainer):
        from ddpo_tpu.training.state import EMA

        self.copy = trainer.state.copies.setdefault(self.NAME, EMA(trainer.state.params, 0.0, 1, trainer.rt))
        return self.copy.swapped_in

    def observe(self, steps: list[dict]) -> None:
        """After an epoch's training: any update's KL over the threshold flags a reset (gardo:683)."""
        self.flagged = self.flagged or any(s.get("kl", 0.0) > self.threshold for s in steps)

    def due(self, epoch: int) -> bool:
        """After sampling epoch `epoch`: reset the copy now? (gardo:471: (epoch != 0 and reset) or epoch - prev_epoch
        > reset_freq)"""
        if not ((epoch != 0 and self.flagged) or epoch - self.last > self.every):
            return False
        if self.copy is not None:
            self.copy.reset()
        self.flagged, self.last = False, epoch
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"gardo_flagged": self.flagged, "gardo_last_reset": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flagged, self.last = bool(state["gardo_flagged"]), int(state["gardo_last_reset"])


__all__ = ["AdaptiveReference"]
