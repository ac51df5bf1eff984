"""``kiln.secrets``: every secret registered is scrubbed from whatever kiln shows, whatever its source.

In-process: the scrubber itself, the points where secrets are registered (credentials, the
bench key) and the boundaries it guards (``KilnError``, warnings, ``--json``, rich output).
The end-to-end cases (a registry and an OpenAI server that echo what they were sent) are
``tests/oci/test_reliability_secrets.py`` and ``tests/bench/test_hostile.py``.
"""

from __future__ import annotations

import base64
import json

import pytest

from kiln import secrets
from kiln.commands.output import Output
from kiln.errors import KilnError
from kiln.oci.credentials import Credentials

pytestmark = pytest.mark.reliability


def test_reliability_credentials_are_scrubbed_in_every_form_from_kiln_errors():
    Credentials("alice", "pa55-word-canary", "test")  # loading them registers them
    basic = base64.b64encode(b"alice:pa55-word-canary").decode()
    err = KilnError(f"r.example/x: forbidden (HTTP 403): DENIED: got Authorization: Basic {basic}\n"
                    f"(alice:pa55-word-canary) {base64.b64encode(b'pa55-word-canary').decode()}")
    assert str(err) == ("r.example/x: forbidden (HTTP 403): DENIED: got Authorization: Basic <redacted> "
                        "(alice:<redacted>) <redacted>")


def test_a_secret_inside_another_goes_whole():
    secrets.register("tok-abc")
    secrets.register("tok-abc-longer-one")
    assert secrets.scrub("a tok-abc-longer-one b tok-abc") == "a <redacted> b <redacted>"


def test_short_or_empty_secrets_are_not_scrubbed():
    for secret in (None, "", "ab"):
        secrets.register(secret)
    assert secrets.scrub("a b ab abc") == "a b ab abc"


def test_scrub_data_walks_json():
    secrets.register("sk-json-canary")
    data = {"error": "echo sk-json-canary", "list": [1, "x sk-json-canary", {"sk-json-canary": None}], "n": 2.5}
    assert secrets.scrub_data(data) == {"error": "echo <redacted>", "list": [1, "x <redacted>", {"<redacted>": None}],
                                        "n": 2.5}


def test_reliability_output_scrubs_warnings_errors_json_and_tables(capsys):
    secrets.register("sk-output-canary")
    out = Output()
    out.warn("server said sk-output-canary")
    out.error("server said sk-output-canary")
    out.reporter().warn("reporter: sk-output-canary")
    out.stdout.print("table cell sk-output-canary")
    out.json({"error": "HTTP 500: Bearer sk-output-canary"})
    captured = capsys.readouterr()
    assert "sk-output-canary" not in captured.out + captured.err
    assert captured.err.count("<redacted>") == 3
    assert json.loads(captured.out.split("\n", 1)[1]) == {"error": "HTTP 500: Bearer <redacted>"}
