"""The run dir and what it holds: its files (files.py), events (events.py), checkpoints (checkpoint.py, checkpoint_layout.py) and buckets (storage*.py). Torch-free except checkpoint.py."""
