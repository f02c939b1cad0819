"""``python -m stalwart.checkpoint JOB_DIR``: run the keeper (see stalwart.checkpoint.keeper)."""

import sys

from stalwart.checkpoint.keeper import main

sys.exit(main())
