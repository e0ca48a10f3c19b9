"""The app's one error type: a problem the user caused or can fix, whose message is shown as is."""


class AppError(ValueError):
    """A user-facing problem (bad input, no database, unknown prototype): the message is shown as is."""
