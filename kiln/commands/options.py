"""The options commands share, declared once: data files, sources, targets, registries, output.

Public API:
    KilnParser                       argparse that reports a usage error in one line (exit 2)
    add_repo_options(parser)         --pins --patchsets --record --images (on the top parser)
    repo_files(args) -> RepoFiles
    command_inputs(args) -> list[Input]   what the command reads, which no output may touch
    add_source_options(parser)       --pin NAME | --vllm VERSION
    add_target_options(parser)       --image --pin --sm --platform   (build, context, values)
    add_registry_options(parser)     --mirror --insecure-registry --registries --connect-timeout --read-timeout,
                                     and --progress (every command that talks to registries is a long one)
    add_progress_option(parser)      --progress auto|plain|tty|quiet
    progress_mode(args) -> str       --progress, else $KILN_PROGRESS, else auto
    add_limit_options(parser)        --max-layer-bytes --max-build-bytes --max-layers --deadline --stall-warning
    add_base_image_options(parser)   the registry and limit options, and --allow-unlocked
    registry_config(args) -> RegistryConfig     (with ``Limits``: the environment, options winning)
    add_json_option(parser)
    sm_option(text) -> int           the one SM validation, as an argparse type
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kiln import paths
from kiln.commands.output import PROGRESS_MODES
from kiln.definitions import check_sm
from kiln.errors import KilnError
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.limits import KNOBS, Limits, parse_knob, seconds_text, size_text
from kiln.paths import RepoFiles
from kiln.publish import destinations
from kiln.publish.destinations import Input


class KilnParser(argparse.ArgumentParser):
    """A usage error is one line naming the option, not argparse's usage banner."""

    def error(self, message: str):
        sys.stderr.write(f"error: {self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def sm_option(text: str) -> int:
    try:
        return check_sm(text, "--sm")
    except KilnError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--sm: ")) from None


def add_repo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pins", type=Path, default=paths.PINS, help="pins file (default: %(default)s)")
    parser.add_argument("--patchsets", type=Path, default=paths.PATCHSETS, help="patch catalogue directory")
    parser.add_argument("--record", type=Path, default=paths.RECORD, help="expected-verdict record")
    parser.add_argument("--images", type=Path, default=paths.IMAGES, help="image definitions directory")


def repo_files(args: argparse.Namespace) -> RepoFiles:
    return RepoFiles(pins=args.pins, patchsets=args.patchsets, record=args.record, images=args.images)


def command_inputs(args: argparse.Namespace) -> list[Input]:
    """Every input the command reads (``kiln.publish.destinations``): no output may touch one."""
    return destinations.command_inputs(repo_files(args), getattr(args, "registries", None))


def add_source_options(parser: argparse.ArgumentParser, train: bool = False) -> None:
    """``--pin NAME | --vllm VERSION``; with ``train``, ``--vllm FIRST..LAST`` too."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--pin", help="a pin from pins.toml, e.g. v0.20.1")
    more = ("; a release the train covers is compared with its table in patchsets/release-train.toml; "
            "or a range FIRST..LAST: every release on the index, compared with that file" if train else "")
    group.add_argument("--vllm", help=f"an unpinned vLLM release as a candidate, e.g. 0.33.0{more}")


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """``--image/--pin/--sm``: which image, pin and GPU arch."""
    parser.add_argument("--image", required=True, help="an image definition in images/, e.g. qwen3.6-27b-tq")
    parser.add_argument("--pin", required=True, help="a pin from pins.toml, e.g. v0.20.1")
    parser.add_argument("--sm", type=sm_option, required=True, help="target SM, one of the image's sms (e.g. 120)")
    parser.add_argument("--platform", metavar="OS/ARCH",
                        help="the base's platform to build on, one the image ships the SM on (default: the "
                             "first of them: linux/amd64, or linux/arm64 for an arm64-only SM such as 121)")


def add_registry_options(parser: argparse.ArgumentParser) -> None:
    """The options of every command that talks to registries."""
    parser.add_argument("--mirror", action="append", metavar="REGISTRY=HOST",
                        help="pull REGISTRY's images from HOST, e.g. docker.io=127.0.0.1:5000 (never used for a push)")
    parser.add_argument("--insecure-registry", action="append", metavar="HOST",
                        help="HOST speaks plain HTTP; https://HOST: TLS without certificate verification")
    parser.add_argument("--registries", type=Path, help="registries config file (mirrors, insecure hosts)")
    for name in ("connect_timeout", "read_timeout"):
        _add_knob(parser, name)
    add_progress_option(parser)


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    """How a long command shows its progress on stderr (``kiln.commands.output``)."""
    parser.add_argument("--progress", choices=PROGRESS_MODES,
                        help="tty: progress bars; plain: one line per finished stage with its bytes and seconds "
                             "(for logs); quiet: none (warnings still shown); auto: tty on a terminal, else plain "
                             "(default: $KILN_PROGRESS, else auto)")


def progress_mode(args: argparse.Namespace) -> str:
    """``--progress``, else ``$KILN_PROGRESS``, else ``auto``."""
    chosen = getattr(args, "progress", None)
    if chosen:
        return chosen
    env = os.environ.get("KILN_PROGRESS", "") or "auto"
    if env not in PROGRESS_MODES:
        raise KilnError(f"KILN_PROGRESS={env!r}: not one of {', '.join(PROGRESS_MODES)}")
    return env


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    """The bounds on what a base image may cost a build (``kiln.oci.limits``; docs/RELIABILITY.md)."""
    group = parser.add_argument_group("limits", "bounds on the work a base image may cause (each also "
                                      "settable by the environment variable named; the option wins)")
    for name in ("layer_bytes", "build_bytes", "layers", "deadline", "stall_warning"):
        _add_knob(group, name)


def _add_knob(parser, name: str) -> None:
    knob = KNOBS[name]
    default = getattr(Limits(), name)
    shown = {"size": size_text, "seconds": seconds_text}.get(knob.kind, str)(default)
    metavar = {"size": "SIZE", "count": "N", "seconds": "TIME"}[knob.kind]
    parser.add_argument(knob.option, dest=name, metavar=metavar, type=_knob_type(knob),
                        help=f"{knob.what} (default {shown}; ${knob.env})")


def _knob_type(knob):
    def parse(text: str):
        try:
            return parse_knob(text, knob, knob.option)
        except KilnError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{knob.option}: ")) from None
    parse.__name__ = knob.kind
    return parse


def limits(args: argparse.Namespace) -> Limits:
    return Limits.from_env(**{name: getattr(args, name, None) for name in KNOBS})


def add_base_image_options(parser: argparse.ArgumentParser) -> None:
    """How a command that pulls the pin's base image reaches it (``build``, ``context``)."""
    add_registry_options(parser)
    add_limit_options(parser)
    parser.add_argument("--allow-unlocked", action="store_true",
                        help="use an unlocked pin, or one whose image no longer resolves to its lock")


def registry_config(args: argparse.Namespace) -> RegistryConfig:
    return RegistryConfig.load(args.mirror or (), args.insecure_registry or (), args.registries, limits(args))


def add_json_option(parser: argparse.ArgumentParser, what: str = "a JSON summary") -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} on stdout")
