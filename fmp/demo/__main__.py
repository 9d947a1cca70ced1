"""``python -m fmp.demo``: run the demo (see ``python -m fmp.demo --help``)."""

import sys

from fmp.demo.cli import main

sys.exit(main())
