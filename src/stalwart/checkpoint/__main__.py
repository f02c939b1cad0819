"""``python -m stalwart.checkpoint JOB_DIR``: run the keeper (see stalwart.checkpoint.keeper_process)."""

import sys

from stalwart.checkpoint.keeper_process import main

sys.exit(main())
