"""python -m trainer.config [--markdown]: the key reference, as docs/training.md holds it."""

import sys

from trainer.config.reference import describe_config

sys.stdout.write(describe_config(markdown="--markdown" in sys.argv[1:]))
