"""`python -m blocklab.cli ...` runs the `blocklab` console script."""

import sys

from .app import main

sys.exit(main())
