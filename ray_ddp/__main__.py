"""``python -m ray_ddp``: the same as the ``ray-ddp`` command (runs on the driver)."""

import sys

from ray_ddp.cli.main import main

sys.exit(main())
