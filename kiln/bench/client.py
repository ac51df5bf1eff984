"""A streaming client for OpenAI-compatible chat completions, timing every chunk.

The standard library's ``http.client`` reads the server-sent events line by line as they
arrive (chunked transfer encoding included), so a chunk's timestamp is when its line came in,
not when some read buffer filled up. One connection per request: a concurrent batch gets one
socket per stream, as separate users would.

Public API:
    Endpoint                       base URL, the model it serves, its reported version
    connect(url, model=None, api_key=None, timeout=10.0) -> Endpoint
                                   GET /v1/models (and /version); KilnError in one line when
                                   the URL does not answer, or answers but is not OpenAI-compatible
    stream_chat(endpoint, body, timeout) -> StreamResult
                                   one POST /v1/chat/completions with ``stream: true``; never
                                   raises for a failed request: ``ok`` False and ``error`` say why
    StreamResult                   ttft, tpot, wall_tps, tokens, text, reasoning, tool calls
    ToolCall                       index, id, name, arguments (the concatenated fragments)
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kiln.errors import KilnError


@dataclass(frozen=True)
class Endpoint:
    url: str  # as the user wrote it
    base: str  # scheme://host[:port][/prefix], without /v1
    model: str
    models: tuple[str, ...]
    server_version: str | None = None
    api_key: str | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        return {"url": self.url, "model": self.model, "models": list(self.models),
                "server_version": self.server_version}


@dataclass
class ToolCall:
    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""

    def to_json(self) -> dict:
        return {"index": self.index, "id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass
class StreamResult:
    ok: bool = False
    error: str | None = None
    sent_at: float = 0.0  # perf_counter() when the request was sent; offsets below are from it
    ttft: float | None = None  # first chunk carrying generated text, reasoning or a tool call
    last_token: float | None = None  # the last such chunk
    wall: float | None = None  # the end of the stream ([DONE], or the failure)
    chunk_offsets: list[float] = field(default_factory=list)  # every generating chunk
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    tokens_from: str = "usage"  # "usage" (the server's count) or "chunks" (no usage was sent)
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        """Decode time per output token after the first: (last - first) / (tokens - 1)."""
        tokens = self.completion_tokens
        if not self.ok or tokens is None or tokens < 2 or self.ttft is None or self.last_token is None:
            return None
        return (self.last_token - self.ttft) / (tokens - 1)

    @property
    def wall_tps(self) -> float | None:
        """Completion tokens per second of the whole request, from send to end of stream."""
        if not self.ok or not self.completion_tokens or not self.wall:
            return None
        return self.completion_tokens / self.wall

    def to_json(self) -> dict:
        return {
            "ok": self.ok, "error": self.error, "ttft": self.ttft, "last_token": self.last_token,
            "wall": self.wall, "tpot": self.tpot, "wall_tps": self.wall_tps,
            "completion_tokens": self.completion_tokens, "prompt_tokens": self.prompt_tokens,
            "tokens_from": self.tokens_from, "finish_reason": self.finish_reason,
            "chunk_offsets": [round(t, 6) for t in self.chunk_offsets],
            "content": self.content, "reasoning": self.reasoning,
            "tool_calls": [call.to_json() for call in self.tool_calls],
        }


# -- HTTP ---------------------------------------------------------------------------------------


def _split(url: str) -> tuple[str, str, int, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise KilnError(f"{url}: not an http:// or https:// URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise KilnError(f"{url}: bad port") from None
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


def _base(url: str) -> str:
    """``http://h:8000``, ``http://h:8000/`` and ``http://h:8000/v1`` all name the same server."""
    scheme, host, port, path = _split(url)
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    netloc = f"[{host}]" if ":" in host else host
    return f"{scheme}://{netloc}:{port}{path}"


def _open(method: str, url: str, body: dict | None, api_key: str | None, timeout: float):
    """Send one request; returns (connection, response). Raises OSError/HTTPException."""
    scheme, host, port, path = _split(url)
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    connection = cls(host, port, timeout=timeout)
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers.update({"Content-Type": "application/json", "Accept": "text/event-stream"})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        connection.request(method, path or "/", body=data, headers=headers)
        return connection, connection.getresponse()
    except BaseException:
        connection.close()
        raise


def _unreachable(url: str, err: BaseException, timeout: float) -> KilnError:
    if isinstance(err, ConnectionRefusedError):
        return KilnError(f"{url}: connection refused (is the server running on that port?)")
    if isinstance(err, socket.gaierror):
        return KilnError(f"{url}: unknown host {urlsplit(url).hostname!r}")
    if isinstance(err, TimeoutError):
        return KilnError(f"{url}: no answer within {timeout:g} s")
    if isinstance(err, http.client.HTTPException | ConnectionResetError):
        return KilnError(f"{url}: not an OpenAI-compatible endpoint (no valid HTTP answer: {type(err).__name__})")
    return KilnError(f"{url}: {type(err).__name__}: {err}")


def _get_json(url: str, path: str, api_key: str | None, timeout: float) -> tuple[int, object]:
    """GET ``_base(url) + path``; errors name ``url``, as the user wrote it."""
    try:
        connection, response = _open("GET", _base(url) + path, None, api_key, timeout)
        try:
            raw = response.read()
        finally:
            connection.close()
    except (OSError, http.client.HTTPException) as err:
        raise _unreachable(url, err, timeout) from None
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, None


def connect(url: str, model: str | None = None, api_key: str | None = None, timeout: float = 10.0) -> Endpoint:
    """The endpoint at ``url`` and the model to ask for (``model``, or the first it serves)."""
    status, data = _get_json(url, "/v1/models", api_key, timeout)
    if status in (401, 403):
        raise KilnError(f"{url}: GET /v1/models answered HTTP {status} (the server wants an API key: --api-key)")
    if status != 200:
        raise KilnError(f"{url}: not an OpenAI-compatible endpoint (GET /v1/models answered HTTP {status})")
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("id"), str) for e in entries):
        raise KilnError(f"{url}: not an OpenAI-compatible endpoint (GET /v1/models returned no model list)")
    models = tuple(e["id"] for e in entries)
    if not models:
        raise KilnError(f"{url}: the server lists no model (GET /v1/models is empty)")
    if model is not None and model not in models:
        raise KilnError(f"{url}: does not serve model {model!r} (it serves {', '.join(models)})")
    version = None
    try:
        status, data = _get_json(url, "/version", api_key, timeout)  # vLLM's; others lack it
        if status == 200 and isinstance(data, dict) and isinstance(data.get("version"), str):
            version = data["version"]
    except KilnError:
        pass
    return Endpoint(url, _base(url), model or models[0], models, version, api_key)


# -- streaming ------------------------------------------------------------------------------------


def _error_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()[:200]
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or error)[:200]
        return str(error)[:200]
    return str(data)[:200]


def _events(response):
    """The ``data`` of each server-sent event, as its last line arrives."""
    lines: list[str] = []
    while True:
        raw = response.readline()
        if not raw:
            if lines:
                yield "\n".join(lines)
            return
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            lines.append(line[5:].lstrip(" "))
        elif not line and lines:
            yield "\n".join(lines)
            lines = []
        # comments (":"), "event:" and "id:" lines carry nothing a chat stream needs


def _absorb(result: StreamResult, chunk: dict, offset: float) -> None:
    """Fold one chunk into ``result``; a chunk that carries output marks a token time."""
    if isinstance(chunk.get("usage"), dict):
        usage = chunk["usage"]
        result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    generated = False
    for choice in chunk.get("choices") or []:
        if choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta") or {}
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
        if delta.get("content"):
            result.content += delta["content"]
            generated = True
        # vLLM calls it reasoning_content (older) or reasoning (newer)
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        if thought:
            result.reasoning += thought
            generated = True
        for fragment in delta.get("tool_calls") or []:
            index = fragment.get("index", 0)
            call = next((c for c in result.tool_calls if c.index == index), None)
            if call is None:
                call = ToolCall(index)
                result.tool_calls.append(call)
            call.id = call.id or fragment.get("id") or ""
            function = fragment.get("function") or {}
            call.name += function.get("name") or ""
            call.arguments += function.get("arguments") or ""
            generated = True
    if generated:
        result.chunk_offsets.append(offset)
        if result.ttft is None:
            result.ttft = offset
        result.last_token = offset


def stream_chat(endpoint: Endpoint, body: dict, timeout: float = 600.0) -> StreamResult:
    """One streamed chat completion; failures are recorded in the result, never raised."""
    body = {**body, "model": body.get("model", endpoint.model), "stream": True}
    body.setdefault("stream_options", {"include_usage": True})
    result = StreamResult(sent_at=time.perf_counter())
    chunks = 0
    connection = None
    try:
        connection, response = _open("POST", f"{endpoint.base}/v1/chat/completions", body, endpoint.api_key, timeout)
        if response.status != 200:
            result.error = f"HTTP {response.status}: {_error_message(response.read())}"
            return result
        kind = response.getheader("Content-Type", "")
        if "text/event-stream" not in kind:
            result.error = f"the answer is not an event stream (Content-Type {kind or 'missing'})"
            return result
        for data in _events(response):
            now = time.perf_counter() - result.sent_at
            if data.strip() == "[DONE]":
                result.wall = now
                result.ok = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                result.error = f"chunk {chunks + 1} is not JSON: {data[:80]!r}"
                return result
            chunks += 1
            if isinstance(chunk, dict) and "error" in chunk:
                result.error = f"server error in the stream: {_error_message(data.encode())}"
                return result
            if isinstance(chunk, dict):
                _absorb(result, chunk, now)
        else:
            # a chunked body cut short reads as an early end here, as does a server that stops
            result.error = f"the stream broke off after {chunks} chunk(s), before [DONE]"
    except (OSError, http.client.HTTPException) as err:
        what = f"no answer within {timeout:g} s" if isinstance(err, TimeoutError) else type(err).__name__
        result.error = f"connection dropped after {chunks} chunk(s) ({what})"
    finally:
        if result.wall is None:
            result.wall = time.perf_counter() - result.sent_at
        if connection is not None:
            connection.close()
    if result.ok and result.completion_tokens is None:
        result.completion_tokens = len(result.chunk_offsets)
        result.tokens_from = "chunks"
    return result
