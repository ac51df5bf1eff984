"""The one error type kiln shows to users (a single line naming the culprit), and ``Interrupted``."""

import signal

from kiln.secrets import scrub


class KilnError(Exception):
    """A user-facing failure. ``str(err)`` is one line naming the file, field or patch at fault.

    Its text is scrubbed of every known secret (``kiln.secrets``): it may quote a server's answer.
    """

    def __init__(self, message: str):
        super().__init__(scrub(" ".join(message.split("\n"))))


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT told the command to stop (``kiln.lifeline``): unwinds like Ctrl-C."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)
