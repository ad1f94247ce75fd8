"""What people see: the console (progress bars, the start screen), the reward curve (plot.py) and the trackers
(tracking.py: wandb, TensorBoard)."""
