"""The two kinds of failure, below every folder so that each can raise them.

An `InputError` means the user's input is wrong (a config key, a file, a dataset, a checkpoint folder): the
entry points print its one line, once, and exit 2, before any compute where it can be known then. Any other
exception is a bug, ours or a library's: it keeps its type and traceback and the process exits 1."""


class InputError(ValueError):
    """Something the user gave is not what is expected; the message names it and says what was."""


class ConfigError(InputError):
    """A config key's value, or a combination of them, cannot run."""


class FieldError(ValueError):
    """A config section's value is out of range (raised where the section is checked: configs/schema.py, a model
    family's record); the config loader prefixes the section's name and makes it a ConfigError."""

    def __init__(self, name: str, value, expected: str):
        super().__init__(f"{name} must be {expected}, got {value}")
