"""The one error type kiln shows to users: a single line naming the culprit."""


class KilnError(Exception):
    """A user-facing failure. ``str(err)`` is one line naming the file, field or patch at fault."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split("\n")))
