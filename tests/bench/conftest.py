"""Fake OpenAI servers for the bench tests, started on 127.0.0.1 and stopped after each test."""

from __future__ import annotations

import pytest

from kiln.bench.battery import CASES
from tests.bench.fake_openai import Behaviour, FakeOpenAI

# user text -> the correct calls: what a well-behaved server streams for each battery case
ANSWERS = {case.user: list(case.example) for case in CASES}


@pytest.fixture
def serve():
    """``serve(**behaviour)`` -> a started FakeOpenAI (stopped at the end of the test)."""
    servers = []

    def start(**settings) -> FakeOpenAI:
        settings.setdefault("answers", ANSWERS)
        server = FakeOpenAI(Behaviour(**settings)).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)
