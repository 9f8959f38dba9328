"""Errors a user can cause. The CLI prints their message and exits non-zero, no traceback."""


class FastMTPError(Exception):
    """Base class: bad input that the user can fix; the message says what to do."""


class DraftFormatError(FastMTPError):
    """A draft directory or checkpoint does not match the expected format."""


class MismatchError(FastMTPError):
    """A draft, table or tokenizer does not fit the target it is used with."""
