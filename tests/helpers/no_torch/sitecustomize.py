"""Makes torch and the libraries built on it unimportable in this process (`--torch-free=only`, tests/conftest.py).

`python` imports `sitecustomize` at start-up from the first folder of sys.path that has one; the tests put this
folder first on PYTHONPATH, so every process a torch-free test starts (the front end, a managed reward, a bench
script) fails at its first `import torch` just as the pytest process does."""

import sys

BLOCKED = ("torch", "torch_xla", "torch_tpu", "torchvision", "diffusers", "transformers", "peft", "open_clip",
           "accelerate")

for _name in BLOCKED:
    if _name not in sys.modules:
        sys.modules[_name] = None  # `import torch` raises ImportError; importlib.util.find_spec says "not installed"
