"""The run dir and what it holds, torch-free (ddpo-status and the front end read it): its files (files.py), sample
videos as mp4, GIF and contact sheets (video.py), events (events.py), what a checkpoint dir is (checkpoint_layout.py)
and buckets (storage*.py)."""
