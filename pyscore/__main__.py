"""`python -m pyscore` is the `pyscore` command line (pyscore.cli)."""

import sys

from pyscore.cli import main

sys.exit(main())
