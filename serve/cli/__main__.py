"""`python -m serve.cli ...`: the same as `manyfold ...`."""

import sys

from serve.cli import main

sys.exit(main())
