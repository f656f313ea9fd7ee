"""The one exception dofattn raises for bad input: the CLI prints its message on one line and exits with 2."""


class UserError(Exception):
    """Something the user asked for cannot be done; the message says what was wrong and what to do."""
