"""The streaming client against a real HTTP server: every figure checked against what it did.

The fake server logs when it wrote each chunk on the same clock as the client, so the
assertions compare kiln's measurement with the server's own times; the slack allowed (SLACK)
is for a loaded 2-core machine, where a thread can wait tens of milliseconds to run.
"""

from __future__ import annotations

import socket
import threading

import pytest

from kiln.bench.client import connect, stream_chat
from kiln.errors import KilnError

SLACK = 0.25  # seconds: scheduling delay a loaded machine may add between a write and a read
PROMPT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1000}


def check_against_the_server(result, logged, configured_ttft):
    assert result.ok, result.error
    assert result.completion_tokens == logged.tokens  # from the server's usage chunk
    # the role chunk (empty content) came at once; TTFT is the first generated chunk
    assert result.ttft >= configured_ttft
    first = result.sent_at + result.ttft
    last = result.sent_at + result.last_token
    assert logged.first <= first <= logged.first + SLACK
    assert logged.last <= last <= logged.last + SLACK
    # TPOT is the decode span over the tokens after the first; the span is the server's, +- slack
    assert result.tpot == pytest.approx((result.last_token - result.ttft) / (logged.tokens - 1))
    assert abs((last - first) - (logged.last - logged.first)) <= SLACK
    assert result.wall_tps == pytest.approx(logged.tokens / result.wall)
    assert logged.last - result.sent_at <= result.wall <= logged.last - result.sent_at + SLACK


def test_ttft_tpot_and_tps_match_what_the_server_sent(serve):
    server = serve(ttft=0.12, token_delay=0.02, tokens=25)
    result = stream_chat(connect(server.url), PROMPT)
    (logged,) = server.posts()
    assert logged.tokens == 25 and logged.chunks == 25
    check_against_the_server(result, logged, 0.12)
    # the server slept 24 x 20 ms between its first and last chunk
    assert logged.last - logged.first >= 24 * 0.02
    assert len(result.chunk_offsets) == 25 and result.content == "tok " * 25


def test_several_tokens_per_chunk_count_as_tokens_not_chunks(serve):
    """MTP: one step streams several tokens; TPOT divides by tokens, from the usage count."""
    server = serve(ttft=0.05, token_delay=0.03, tokens=30, tokens_per_chunk=3)
    result = stream_chat(connect(server.url), PROMPT)
    (logged,) = server.posts()
    assert (logged.tokens, logged.chunks) == (30, 10)
    check_against_the_server(result, logged, 0.05)
    assert len(result.chunk_offsets) == 10
    assert result.tokens_from == "usage"


def test_reasoning_counts_as_output_and_is_kept_apart(serve):
    server = serve(ttft=0.05, tokens=12, reasoning_tokens=5)
    result = stream_chat(connect(server.url), PROMPT)
    check_against_the_server(result, server.posts()[0], 0.05)
    assert result.reasoning == "tok " * 5 and result.content == "tok " * 7


def test_without_usage_the_chunks_are_counted(serve):
    server = serve(tokens=9, tokens_per_chunk=3, send_usage=False)
    result = stream_chat(connect(server.url), PROMPT)
    assert result.ok and result.completion_tokens == 3 and result.tokens_from == "chunks"


def test_max_tokens_is_sent_and_honoured(serve):
    server = serve(tokens=50)
    result = stream_chat(connect(server.url), {**PROMPT, "max_tokens": 7})
    assert result.completion_tokens == 7
    body = server.posts()[0].body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model"


def test_a_connection_dropped_mid_stream_is_a_failed_result_not_an_exception(serve):
    server = serve(tokens=20, drop_requests=frozenset({0}), drop_after_chunks=4)
    result = stream_chat(connect(server.url), PROMPT)
    assert not result.ok
    assert result.error == "the stream broke off after 5 chunk(s), before [DONE]"  # the role chunk + 4
    assert server.posts()[0].dropped
    assert result.content == "tok " * 4  # what did arrive is kept
    assert result.wall_tps is None and result.tpot is None


def test_an_http_error_is_a_failed_result_with_the_servers_message(serve):
    server = serve()
    endpoint = connect(server.url)
    result = stream_chat(endpoint, {**PROMPT, "model": "other-model"})
    assert not result.ok and result.error == "HTTP 404: model other-model not found"


def test_connect_reads_the_model_list_and_version(serve):
    server = serve(models=("qwen-a", "qwen-b"))
    for url in (server.url, server.url + "/", server.url + "/v1", server.url + "/v1/"):
        endpoint = connect(url)
        assert endpoint.base == server.url and endpoint.model == "qwen-a"
        assert endpoint.models == ("qwen-a", "qwen-b") and endpoint.server_version == "0.20.1+fake"
    assert connect(server.url, model="qwen-b").model == "qwen-b"
    with pytest.raises(KilnError, match=r"does not serve model 'qwen-c' \(it serves qwen-a, qwen-b\)"):
        connect(server.url, model="qwen-c")


def one_line(err: KilnError) -> str:
    message = str(err)
    assert "\n" not in message
    return message


def test_connection_refused_is_one_line_naming_the_url():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(KilnError) as caught:
        connect(f"http://127.0.0.1:{port}")
    assert one_line(caught.value) == f"http://127.0.0.1:{port}: connection refused (is the server running on that port?)"


def test_a_server_without_the_openai_api_is_refused_in_one_line(serve):
    server = serve(models_status=404, models_body="<html>Not Found</html>")
    with pytest.raises(KilnError) as caught:
        connect(server.url)
    assert one_line(caught.value) == (
        f"{server.url}: not an OpenAI-compatible endpoint (GET /v1/models answered HTTP 404)")
    server = serve(models_status=200, models_body="<html>a web page</html>")
    with pytest.raises(KilnError, match=r"not an OpenAI-compatible endpoint \(GET /v1/models returned no model list\)"):
        connect(server.url)


def test_a_server_that_does_not_speak_http_is_refused_in_one_line():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer():
        connection, _ = listener.accept()
        connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        connection.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(KilnError) as caught:
            connect(f"http://127.0.0.1:{port}")
        assert one_line(caught.value).startswith(
            f"http://127.0.0.1:{port}: not an OpenAI-compatible endpoint (no valid HTTP answer")
    finally:
        thread.join(5)
        listener.close()


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(KilnError, match=r"^ftp://x: not an http:// or https:// URL$"):
        connect("ftp://x")
