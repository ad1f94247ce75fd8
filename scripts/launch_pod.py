#!/usr/bin/env python
"""The pod launcher is `ddpo-pod` (ddpo_tpu/launch/pod.py); this name is kept for existing command lines."""

import sys

from ddpo_tpu.launch.pod import main

if __name__ == "__main__":
    sys.exit(main())
