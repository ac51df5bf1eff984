"""A real HTTP server that streams the OpenAI chat protocol the way vLLM does, on 127.0.0.1.

Timings, token counts and faults are set by a ``Behaviour``; every request is logged with the
server-side times at which its chunks were written (``time.perf_counter()``, the same clock as
the client in the same process), so tests compare kiln's figures with what the server did.

Stream shape (vLLM's ``serving_chat``): a first chunk with ``delta.role`` and empty content,
then one chunk per engine step with ``delta.content`` / ``delta.reasoning_content`` /
``delta.tool_calls`` (index, id, type, function.name, then ``function.arguments`` fragments),
a chunk with ``finish_reason``, a ``usage`` chunk with empty ``choices`` when
``stream_options.include_usage`` is set, then ``data: [DONE]``; chunked transfer encoding.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Behaviour:
    ttft: float = 0.03  # seconds from the request to the first generated chunk
    ttft_cycle: tuple[float, ...] = ()  # per-request TTFTs, cycling (designed noise)
    token_delay: float = 0.005  # seconds between generated chunks
    delay_cycle: tuple[float, ...] = ()  # per-request token delays, cycling (designed noise)
    tokens: int = 20  # completion tokens (capped by max_tokens)
    tokens_per_chunk: int = 1  # > 1: several tokens per step, as with MTP
    reasoning_tokens: int = 0  # the first tokens go to reasoning_content
    send_usage: bool = True
    drop_requests: frozenset[int] = frozenset()  # request numbers (0-based POSTs) that drop mid-stream
    drop_after_chunks: int = 3
    tool_mode: str = "clean"  # clean | p64 | leak | bad_json | wrong_name | in_reasoning
    answers: dict = field(default_factory=dict)  # user text -> [(function name, arguments)]
    models: tuple[str, ...] = ("fake-model",)
    models_status: int = 200
    models_body: str | None = None  # replaces the model list (with models_status)
    version: str | None = "0.20.1+fake"


@dataclass
class Logged:
    number: int
    body: dict
    received: float
    first: float | None = None  # when the first generated chunk's write began
    last: float | None = None
    tokens: int = 0
    chunks: int = 0
    dropped: bool = False


def _chunk(model: str, delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": choices}
    if usage is not None:
        data["usage"] = usage
    return data


def _fragments(text: str, size: int = 7) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client that hung up is no news
        pass


class FakeOpenAI:
    def __init__(self, behaviour: Behaviour | None = None, port: int = 0):
        self.behaviour = behaviour or Behaviour()
        self.log: list[Logged] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                server._get(self)

            def do_POST(self):
                server._post(self)

        self.httpd = _QuietServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def posts(self) -> list[Logged]:
        return [entry for entry in self.log if entry.body.get("messages")]

    # -- GET ------------------------------------------------------------------------------------

    def _get(self, handler) -> None:
        b = self.behaviour
        if handler.path == "/v1/models":
            if b.models_body is not None:
                self._send(handler, b.models_status, b.models_body.encode(), "text/html")
                return
            body = {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "vllm"} for m in b.models]}
            self._send(handler, b.models_status, json.dumps(body).encode(), "application/json")
        elif handler.path == "/version" and b.version:
            self._send(handler, 200, json.dumps({"version": b.version}).encode(), "application/json")
        else:
            self._send(handler, 404, b'{"detail":"Not Found"}', "application/json")

    @staticmethod
    def _send(handler, status: int, data: bytes, kind: str) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    # -- POST: the stream -------------------------------------------------------------------------

    def _post(self, handler) -> None:
        received = time.perf_counter()
        body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        with self._lock:
            entry = Logged(len(self.log), body, received)
            self.log.append(entry)
        b = self.behaviour
        model = body.get("model", "?")
        if body.get("model") not in b.models:
            self._send(handler, 404, json.dumps({"error": {"message": f"model {model} not found"}}).encode(),
                       "application/json")
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()

        def write(data) -> None:
            payload = b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            handler.wfile.flush()

        write(_chunk(model, {"role": "assistant", "content": ""}))  # before any output, as vLLM's role chunk
        steps = self._steps(body)
        number = sum(1 for e in self.posts() if e.number < entry.number)  # this POST's 0-based number
        delay = b.delay_cycle[number % len(b.delay_cycle)] if b.delay_cycle else b.token_delay
        ttft = b.ttft_cycle[number % len(b.ttft_cycle)] if b.ttft_cycle else b.ttft
        time.sleep(max(0.0, ttft - (time.perf_counter() - received)))
        for index, (delta, tokens) in enumerate(steps):
            if index:
                time.sleep(delay)
            if number in b.drop_requests and entry.chunks == b.drop_after_chunks:
                entry.dropped = True
                handler.close_connection = True
                handler.connection.shutdown(socket.SHUT_RDWR)
                return
            now = time.perf_counter()  # before the write: the client cannot read it any earlier
            write(_chunk(model, delta))
            entry.first = entry.first if entry.first is not None else now
            entry.last, entry.tokens, entry.chunks = now, entry.tokens + tokens, entry.chunks + 1
        finish = "tool_calls" if any("tool_calls" in d for d, _ in steps) else "stop"
        write(_chunk(model, {}, finish))
        if b.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
            write(_chunk(model, usage={"prompt_tokens": prompt_tokens, "completion_tokens": entry.tokens,
                                       "total_tokens": prompt_tokens + entry.tokens}))
        write(b"[DONE]")
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()
        handler.close_connection = True

    def _steps(self, body: dict) -> list[tuple[dict, int]]:
        """The generated deltas of this request and the tokens each one stands for."""
        b = self.behaviour
        if body.get("tools"):
            return self._tool_steps(body)
        total = min(b.tokens, body.get("max_tokens") or b.tokens)
        steps, produced = [], 0
        while produced < total:
            n = min(b.tokens_per_chunk, total - produced)
            field_name = "reasoning_content" if produced < b.reasoning_tokens else "content"
            steps.append(({field_name: "tok " * n}, n))
            produced += n
        return steps

    def _tool_steps(self, body: dict) -> list[tuple[dict, int]]:
        b = self.behaviour
        user = body["messages"][-1]["content"]
        calls = b.answers.get(user, [])
        steps: list[tuple[dict, int]] = [({"reasoning_content": "Let me think. "}, 3)]
        if not calls:
            return [*steps, ({"content": "Paris"}, 1)]
        if b.tool_mode in ("leak", "in_reasoning"):
            markup = "".join(
                f"<tool_call>\n<function={name}>\n"
                + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
                + "</function>\n</tool_call>" for name, args in calls)
            where = "content" if b.tool_mode == "leak" else "reasoning_content"
            return [*steps, *(({where: piece}, 1) for piece in _fragments(markup, 12))]
        for index, (name, args) in enumerate(calls):
            if b.tool_mode == "wrong_name":
                name = name + "_v2"
            text = json.dumps(args)
            if b.tool_mode == "bad_json":
                text = repr(args)  # Python's repr: single quotes, True
            if b.tool_mode == "p64" and index == len(calls) - 1:
                # vllm#39598: the last parameter came with </function>; the client gets "{}" or
                # the JSON up to the last parameter, never closed
                items = list(args.items())
                text = "{}" if len(items) == 1 else json.dumps(dict(items[:-1]))[:-1] + ", "
            head = {"index": index, "id": f"chatcmpl-tool-{uuid.uuid4().hex[:8]}", "type": "function",
                    "function": {"name": name, "arguments": ""}}
            steps.append(({"tool_calls": [head]}, 2))
            steps += [({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}, 2)
                      for piece in _fragments(text)]
        return steps
