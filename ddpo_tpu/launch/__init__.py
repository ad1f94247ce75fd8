"""The front end's helpers: the training process's environment (env.py) and the process itself (process.py)."""
