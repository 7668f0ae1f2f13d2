"""`python -m harness.cli`: the `harness` command."""

import sys

from harness.cli.main import main

sys.exit(main())
