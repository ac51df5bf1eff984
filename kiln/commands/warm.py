"""``warm``: boot a built image once and write its compile caches as a bundle; ``warm-answers``: the
fixed request set's greedy answers from a running server (to compare a warm boot with a cold one).

    build.py warm --image NAME --pin PIN --sm SM --rootfs DIR --out DIR [--model PATH]
                  [--bind HOST:IMAGE_PATH ...] [--python PATH] [--port N] [--json]
    build.py warm-answers URL --model NAME [--json]

``--rootfs``: the built image unpacked (``umoci unpack``, ``docker export``); the server runs there
in a chroot (root), on this machine's hardware, which must be the image's (its SM, or the CPU).
Then ``build.py build … --warm DIR`` bakes the bundle (docs/WARM.md).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from kiln.commands import options
from kiln.errors import KilnError
from kiln.image.inputs import load_build_inputs
from kiln.warm.boot import send_requests
from kiln.warm.run import warm_rootfs


def register(sub) -> None:
    p = sub.add_parser("warm", help="boot a built image once and capture vLLM's compile caches as a bundle")
    options.add_target_options(p)
    p.add_argument("--rootfs", type=Path, required=True, help="the built image, unpacked (the server runs there)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the bundle's folder (new or empty)")
    p.add_argument("--model", help="what `vllm serve` is given (default: the definition's model id)")
    p.add_argument("--bind", action="append", default=[], metavar="HOST:IMAGE_PATH",
                   help="a host folder mounted in the rootfs for the boot (the model's, say)")
    p.add_argument("--python", default="/opt/venv/bin/python", help="the image's Python (default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="the server's port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for /health (default: %(default)s)")
    options.add_json_option(p)
    p.set_defaults(run=run_warm)
    a = sub.add_parser("warm-answers", help="the warm step's fixed request set, sent to a running server")
    a.add_argument("url", help="the endpoint, e.g. http://127.0.0.1:8000")
    a.add_argument("--model", required=True, help="the served model name")
    options.add_json_option(a)
    a.set_defaults(run=run_answers)


def binds_of(values: list[str]) -> dict[str, str]:
    binds = {}
    for value in values:
        host, sep, guest = value.rpartition(":")
        if not sep or not host or not guest.startswith("/") or not Path(host).is_dir():
            raise KilnError(f"--bind {value}: not HOST_FOLDER:/IMAGE/PATH with an existing host folder")
        binds[str(Path(host).resolve())] = guest
    return binds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_warm(args, out) -> int:
    inputs = load_build_inputs(options.repo_files(args), args.image, args.pin, args.sm, platform=args.platform)
    if not args.rootfs.is_dir():
        raise KilnError(f"--rootfs {args.rootfs}: not a folder")
    record = warm_rootfs(args.rootfs.resolve(), inputs.definition, args.out.resolve(),
                         args.model or inputs.definition.model.id, binds_of(args.bind),
                         args.port or free_port(), args.python, args.timeout)
    if args.json:
        out.json(record)
        return 0
    out.stdout.print(f"warm {record['key']}: {len(record['files'])} files, {record['bytes']} bytes in {args.out}; "
                     f"healthy in {record['seconds_to_healthy']} s, {len(record['answers'])} answers")
    return 0


def run_answers(args, out) -> int:
    answers = send_requests(args.url.rstrip("/").removesuffix("/v1"), args.model)
    if args.json:
        out.json({"answers": answers})
    else:
        out.stdout.print(json.dumps(answers, indent=1))
    return 0
