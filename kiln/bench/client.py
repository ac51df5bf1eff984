"""A streaming client for OpenAI-compatible chat completions, timing every chunk.

The standard library's ``http.client`` reads the server-sent events line by line as they
arrive (chunked transfer encoding included), so a chunk's timestamp is when its line came in,
not when some read buffer filled up. One connection per request: a concurrent batch gets one
socket per stream, as separate users would.

The server is not trusted: every read is bounded (``kiln.bench.wire``), every chunk is checked
against the protocol before it counts (a string where a list belongs, text that is not a
string, a token count that is negative or more than the request allowed), and whatever is
wrong fails that one sample with a one-line reason. The API key is registered with
``kiln.secrets``, so a server that echoes it is scrubbed of it.

Public API:
    Endpoint                       base URL, the model it serves, its reported version
    connect(url, model=None, api_key=None, timeout=10.0, bounds=Bounds()) -> Endpoint
                                   GET /v1/models (and /version); KilnError in one line when
                                   the URL does not answer, or answers but is not OpenAI-compatible
    stream_chat(endpoint, body, timeout, bounds=Bounds(), deadline=None) -> StreamResult
                                   one POST /v1/chat/completions with ``stream: true``; never
                                   raises for a failed request: ``ok`` False and ``error`` say why
                                   in one line. ``timeout`` bounds the whole request, stream
                                   included; ``deadline`` (perf_counter) the run it is part of
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

from kiln.bench.wire import (
    DEFAULT_BOUNDS,
    Bounds,
    Malformed,
    Oversize,
    Watchdog,
    events,
    kind,
    quote,
    read_body,
    typed,
)
from kiln.errors import KilnError
from kiln.secrets import register


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

ERROR_BODY_BYTES = 64 * 1024  # of a failed request's body: its message is cut to 200 characters
# A completion cannot be longer than the max_tokens it asked for; without one, no model's
# context holds this many tokens.
MAX_COMPLETION_TOKENS = 100_000_000


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


def _connection(url: str, timeout: float):
    """An unopened connection to ``url``'s host (each socket operation bounded by ``timeout``)."""
    scheme, host, port, path = _split(url)
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    # a socket timeout must fit the OS's clock; the watchdog bounds the request anyway
    return cls(host, port, timeout=min(max(timeout, 0.001), 1e7)), path or "/"


def _send(connection, watchdog: Watchdog, method: str, path: str, body: dict | None, api_key: str | None):
    """Connect (the watchdog watching the socket), send one request; returns the response.

    Raises OSError/HTTPException.
    """
    connection.connect()
    watchdog.watch(connection.sock)
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers.update({"Content-Type": "application/json", "Accept": "text/event-stream"})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    connection.request(method, path, body=data, headers=headers)
    return connection.getresponse()


def _hang_up(connection, response) -> None:
    """Close both: a ``Connection: close`` answer holds the socket after the connection lets go."""
    if response is not None:
        response.close()
    connection.close()


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


def _get_json(url: str, path: str, api_key: str | None, timeout: float, bounds: Bounds) -> tuple[int, object]:
    """GET ``_base(url) + path`` within ``timeout`` in all; errors name ``url``, as the user wrote it."""
    connection, target = _connection(_base(url) + path, timeout)
    watchdog = Watchdog(time.perf_counter() + timeout)
    response = None
    try:
        with watchdog:
            response = _send(connection, watchdog, "GET", target, None, api_key)
            raw = read_body(response, bounds.max_body, f"GET {path}")
    except Oversize as err:
        raise KilnError(f"{url}: not an OpenAI-compatible endpoint ({err})") from None
    except (OSError, http.client.HTTPException) as err:
        if watchdog.fired:
            raise KilnError(f"{url}: GET {path} did not complete within {timeout:g} s") from None
        raise _unreachable(url, err, timeout) from None
    finally:
        _hang_up(connection, response)
    try:
        return response.status, json.loads(raw)
    except (ValueError, RecursionError):
        return response.status, None


def _listed(models: tuple[str, ...], shown: int = 10) -> str:
    more = f" and {len(models) - shown} more" if len(models) > shown else ""
    return ", ".join(quote(m, 80) for m in models[:shown]) + more


def connect(url: str, model: str | None = None, api_key: str | None = None, timeout: float = 10.0,
            bounds: Bounds = DEFAULT_BOUNDS) -> Endpoint:
    """The endpoint at ``url`` and the model to ask for (``model``, or the first it serves)."""
    register(api_key)  # scrubbed from every message and evidence file, whoever echoes it
    status, data = _get_json(url, "/v1/models", api_key, timeout, bounds)
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
        raise KilnError(f"{url}: does not serve model {model!r} (it serves {_listed(models)})")
    version = None
    try:
        status, data = _get_json(url, "/version", api_key, timeout, bounds)  # vLLM's; others lack it
        if status == 200 and isinstance(data, dict) and isinstance(data.get("version"), str):
            version = quote(data["version"], 80)
    except KilnError:
        pass
    return Endpoint(url, _base(url), model or models[0], models, version, api_key)


# -- streaming ------------------------------------------------------------------------------------


def _error_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return quote(raw.decode(errors="replace"))
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            return quote(str(error.get("message") or error.get("detail") or error))
        return quote(str(error))
    return quote(str(data))


def _ceiling(body: dict) -> int:
    """The most completion tokens the request allows (the larger cap, when both are set)."""
    caps = [v for v in (body.get("max_tokens"), body.get("max_completion_tokens"))
            if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return max(caps) if caps else MAX_COMPLETION_TOKENS


class _Parts:
    """What a stream has said so far, in pieces: appending to a str each chunk is quadratic."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, tuple[ToolCall, list[str], list[str]]] = {}  # index -> call, names, arguments

    def finish(self, result: StreamResult) -> None:
        result.content, result.reasoning = "".join(self.content), "".join(self.reasoning)
        for call, names, arguments in self.calls.values():
            call.name, call.arguments = "".join(names), "".join(arguments)
        result.tool_calls = [call for call, _, _ in self.calls.values()]


def _absorb(result: StreamResult, parts: _Parts, chunk: dict, offset: float, ceiling: int) -> None:
    """Fold one chunk into ``result``; a chunk that carries output marks a token time.

    ``Malformed`` when the chunk breaks the protocol: the sample fails, naming the field.
    """
    where = ""  # the path of a field in the chunk, for messages
    usage = typed(chunk, "usage", dict, where)
    if usage is not None:
        for key in ("completion_tokens", "prompt_tokens"):
            count = typed(usage, key, int, "usage")
            if count is not None and count < 0:
                raise Malformed(f"usage.{key} is {count}: a token count cannot be negative")
        completion = usage.get("completion_tokens")
        if completion is not None and completion > ceiling:
            shown = completion if completion < 10**15 else f"{completion:.3g}"
            raise Malformed(f"usage.completion_tokens is {shown}, more than the {ceiling} the request allowed")
        result.completion_tokens = completion if completion is not None else result.completion_tokens
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    generated = False
    for number, choice in enumerate(typed(chunk, "choices", list, where) or []):
        here = f"choices[{number}]"
        if not isinstance(choice, dict):
            raise Malformed(f"{here} is {kind(choice)}, not an object")
        if typed(choice, "index", int, here) not in (0, None):
            continue
        delta = typed(choice, "delta", dict, here) or {}
        if finish := typed(choice, "finish_reason", str, here):
            result.finish_reason = finish
        if content := typed(delta, "content", str, f"{here}.delta"):
            parts.content.append(content)
            generated = True
        # vLLM calls it reasoning_content (older) or reasoning (newer)
        thought = typed(delta, "reasoning_content", str, f"{here}.delta") or typed(delta, "reasoning", str, f"{here}.delta")
        if thought:
            parts.reasoning.append(thought)
            generated = True
        for place, fragment in enumerate(typed(delta, "tool_calls", list, f"{here}.delta") or []):
            spot = f"{here}.delta.tool_calls[{place}]"
            if not isinstance(fragment, dict):
                raise Malformed(f"{spot} is {kind(fragment)}, not an object")
            index = typed(fragment, "index", int, spot) or 0
            call, names, arguments = parts.calls.setdefault(index, (ToolCall(index), [], []))
            call.id = call.id or typed(fragment, "id", str, spot) or ""
            function = typed(fragment, "function", dict, spot) or {}
            names.append(typed(function, "name", str, f"{spot}.function") or "")
            arguments.append(typed(function, "arguments", str, f"{spot}.function") or "")
            generated = True
    if generated:
        result.chunk_offsets.append(offset)
        if result.ttft is None:
            result.ttft = offset
        result.last_token = offset


def stream_chat(endpoint: Endpoint, body: dict, timeout: float = 600.0, bounds: Bounds = DEFAULT_BOUNDS,
                deadline: float | None = None) -> StreamResult:
    """One streamed chat completion; failures are recorded in the result, never raised."""
    body = {**body, "model": body.get("model", endpoint.model), "stream": True}
    body.setdefault("stream_options", {"include_usage": True})
    result = StreamResult(sent_at=time.perf_counter())
    end = result.sent_at + timeout
    cut_by_run = deadline is not None and deadline < end
    end = min(end, deadline) if deadline is not None else end
    parts, chunks = _Parts(), 0
    connection, target = _connection(f"{endpoint.base}/v1/chat/completions", end - result.sent_at)
    watchdog = Watchdog(end)
    response = None
    try:
        with watchdog:
            response = _send(connection, watchdog, "POST", target, body, endpoint.api_key)
            if response.status != 200:
                result.error = f"HTTP {response.status}: {_error_message(response.read(ERROR_BODY_BYTES))}"
                return result
            content_type = response.getheader("Content-Type", "")
            if "text/event-stream" not in content_type:
                result.error = f"the answer is not an event stream (Content-Type {quote(content_type, 80) or 'missing'})"
                return result
            for data in events(response, bounds):
                now = time.perf_counter() - result.sent_at
                if watchdog.fired:
                    break
                if data.strip() == "[DONE]":
                    result.wall = now
                    result.ok = True
                    break
                try:
                    chunk = json.loads(data)
                except (ValueError, RecursionError):
                    result.error = f"chunk {chunks + 1} is not JSON: {data[:80]!r}"
                    return result
                chunks += 1
                if not isinstance(chunk, dict):
                    raise Malformed(f"chunk {chunks} is {kind(chunk)}, not an object")
                if "error" in chunk:
                    result.error = f"server error in the stream: {_error_message(data.encode())}"
                    return result
                try:
                    _absorb(result, parts, chunk, now, _ceiling(body))
                except Malformed as err:
                    raise Malformed(f"chunk {chunks}: {err}") from None
            else:
                # a chunked body cut short reads as an early end here, as does a server that stops
                result.error = f"the stream broke off after {chunks} chunk(s), before [DONE]"
    except (Malformed, Oversize) as err:
        result.error = str(err)
    except (OSError, http.client.HTTPException) as err:
        what = f"no answer within {timeout:g} s" if isinstance(err, TimeoutError) else type(err).__name__
        result.error = f"connection dropped after {chunks} chunk(s) ({what})"
    finally:
        if result.wall is None:
            result.wall = time.perf_counter() - result.sent_at
        _hang_up(connection, response)
        parts.finish(result)
    if watchdog.fired and not result.ok:
        result.error = (f"the run reached its --run-timeout after {chunks} chunk(s)" if cut_by_run else
                        f"no complete answer within the --timeout of {timeout:g} s ({chunks} chunk(s) came)")
    if result.ok and result.completion_tokens is None:
        result.completion_tokens = len(result.chunk_offsets)
        result.tokens_from = "chunks"
    return result
