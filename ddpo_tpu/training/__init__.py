"""The one training loop (loop.py), the training state (state.py), checkpointing (checkpointing.py, checkpoint_files.py)
and what a run reports (reporting.py)."""
