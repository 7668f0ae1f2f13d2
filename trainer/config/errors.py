"""The error of a config that can't be used (its own module: the checks and the roles section both raise it)."""


class ConfigError(ValueError):
    """A config that can't be used; the message names the key, the value and what to do."""
