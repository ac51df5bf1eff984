"""Boot an image's own vLLM from its unpacked files, and the fixed request set a warm boot sends.

``boot_chroot`` runs ``vllm serve`` in the rootfs as the init of new PID and mount namespaces
(``unshare``: when the server stops or kiln dies, the kernel kills all of it and drops its mounts),
with /proc, /sys, /dev and each ``binds`` folder mounted; it needs root. The request set covers
the batch shapes the engine compiles for (1, 2 and 4 requests at once) with greedy sampling, so
the same image answers the same text: the serve check compares a cold and a warm boot's answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kiln import lifeline
from kiln.errors import KilnError

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "The quick brown fox", "import numpy as np\n")
BATCHES = (1, 2, 4)  # requests in flight at once: the batch shapes the engine compiles for
MAX_TOKENS = 12
MAX_ANSWER = 1 << 20
IN_CHROOT = """set -e
root=$1; shift
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
while [ "$1" != "--" ]; do mkdir -p "$root$2"; mount --bind "$1" "$root$2"; shift 2; done
shift
exec chroot "$root" "$@"
"""


def chroot_argv(rootfs: Path, binds: dict[str, str], argv: list[str]) -> list[str]:
    """``argv`` run in ``rootfs`` (own PID and mount namespaces) with ``binds`` (host -> image path) mounted."""
    for point in ("proc", "sys", "dev"):
        (rootfs / point).mkdir(exist_ok=True)
    pairs = [word for host, guest in sorted(binds.items()) for word in (host, guest)]
    return ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
            "sh", "-c", IN_CHROOT, "sh", str(rootfs), *pairs, "--", *argv]


def boot_chroot(rootfs: Path, binds: dict[str, str], serve: list[str], env: dict[str, str],
                log: Path) -> subprocess.Popen:
    """The server, started (not yet healthy); its output in ``log``."""
    argv = chroot_argv(rootfs, binds, ["/usr/bin/env", "-i", *[f"{k}={v}" for k, v in sorted(env.items())], *serve])
    parent = os.getpid()
    with open(log, "wb") as out:  # cwd "/": a chroot keeps the working directory
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd="/",
                                preexec_fn=lambda: lifeline.child_of(parent))


def wait_healthy(process: subprocess.Popen, url: str, log: Path, deadline_s: float) -> float:
    """Seconds from now until ``GET /health`` answers 200; one line when the server exits or the deadline passes."""
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        if process.poll() is not None:
            lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            raise KilnError(f"the server exited ({process.returncode}) before /health: {lines[-1] if lines else ''}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return time.monotonic() - started
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise KilnError(f"no answer on {url}/health within {deadline_s:.0f} s (log: {log})")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's session, SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def complete(url: str, model: str, prompt: str, timeout: float = 300) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "seed": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read(MAX_ANSWER))["choices"][0]["text"]
    except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError) as err:
        raise KilnError(f"{url}/v1/completions: {err}") from None


def send_requests(url: str, model: str) -> list[dict]:
    """The fixed request set: each batch shape in turn, its prompts at once; greedy answers in order."""
    answers, at = [], 0
    for batch in BATCHES:
        prompts = [PROMPTS[(at + i) % len(PROMPTS)] for i in range(batch)]
        at += batch
        with ThreadPoolExecutor(batch) as pool:
            texts = list(pool.map(lambda p: complete(url, model, p), prompts))
        answers += [{"batch": batch, "prompt": p, "text": t} for p, t in zip(prompts, texts, strict=True)]
    return answers
