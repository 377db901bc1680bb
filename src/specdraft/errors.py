"""The one error type a user mistake raises: the CLI prints its message without a traceback."""


class SpecdraftError(Exception):
    """A problem the user can fix; the message says what to do."""
