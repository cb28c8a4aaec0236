"""The base of every error a user can fix (bad spec, bad data, no fit, device refusal, cloud refusal).

The CLI prints these as one ``error: ...`` message with a non-zero exit; anything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """A problem in the user's input or environment; the message says what and how to fix it."""


class DataError(UserError, ValueError):
    """A record or file that cannot be used; the message names file and line."""
