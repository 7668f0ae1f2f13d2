"""`harness train config.yaml`: the keys (keys.py), reading the YAML into them (load.py), the keys as data
(reference.py), the checks (checks.py) and the roles section (roles.py: role rules, trained roles, policies).
`python -m trainer.config [--markdown]` prints the key reference."""

from trainer.config.load import *  # noqa: F403  the public names are load.py's __all__
from trainer.config.load import __all__  # noqa: F401
