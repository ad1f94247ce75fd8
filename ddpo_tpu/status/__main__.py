import sys

from ddpo_tpu.status.cli import main

sys.exit(main())
