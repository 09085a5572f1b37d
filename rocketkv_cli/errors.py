"""Error types. Every known failure is a `RocketKVError`; the CLI maps it to one line and exit code 1
(2 for a `UsageError`: an option value the command cannot take, as for a malformed option)."""

from __future__ import annotations


class RocketKVError(Exception):
    """Base class of rocketkv's known failures.

    `hint` is the next command or action for the user; the CLI prints it after the message.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} — {self.hint}"


class InputError(RocketKVError):
    """A document or question that cannot be used (missing, unreadable, empty, not text)."""


class UsageError(InputError):
    """An option value a command cannot take whatever the input (out of range, malformed, two
    options that contradict each other): a usage error, exit code 2 at the command line, like a
    value the option parser refuses. Messages name the API's fields; the CLI shows option names."""


class ModelLoadError(RocketKVError):
    """A model that cannot be found, loaded, or is of an unsupported architecture."""


class CacheFormatError(RocketKVError):
    """A `.kv` file that is damaged, of another format version, or built for another model."""

    @classmethod
    def cut_header(cls, path: object, n: int, size: int, hint: str) -> CacheFormatError:
        """The error for a file whose header (`n` bytes, starting with "{") runs past its end
        (`size` bytes in all): a cache cut short, as an interrupted copy leaves it."""
        return cls(f"{path} is truncated: {size:,} bytes, shorter than its own header ({n + 8:,} bytes)", hint)


class BudgetError(RocketKVError):
    """Budgets or lengths that cannot work (document longer than the context, question too long)."""


class OutputError(RocketKVError):
    """A target path that cannot be written (exists without --force, missing directory, symlink)."""
