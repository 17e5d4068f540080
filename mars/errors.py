"""Exceptions the ``mars`` command reports as one clear line instead of a traceback."""


class MarsError(Exception):
    """A failure the user can fix: the message names what and where."""


class ConfigError(MarsError, ValueError):
    """A wrong or missing key in params.yaml (the message names the key)."""


class DataError(MarsError, ValueError):
    """Unusable input data (the message names the file and row)."""
