"""``build.py build``, ``context`` and ``values``: one image, its outputs, its Helm values."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.markup import escape

from kiln.attest.dsse import load_public_key, load_signing_key
from kiln.commands import options
from kiln.errors import KilnError
from kiln.image.cachelookup import cached_catalogue
from kiln.image.inputs import destination, load_build_inputs
from kiln.image.regcache import parse_cache_location
from kiln.pipeline import record_opener, run_build
from kiln.publish import Publisher
from kiln.publish.archive import ArchivePublisher
from kiln.publish.context import ContextPublisher
from kiln.publish.layout import LayoutPublisher
from kiln.publish.registry import RegistryPublisher
from kiln.publish.values import CHARTS, ValuesPublisher, built_values, values_bytes
from kiln.targets import host_platform


def register(sub) -> None:
    p = _image_command(sub, "build", "build a patched image for one pin and SM (pull, bake, publish)", run_build_command)
    p.add_argument("--push", action="store_true", help="push to the image's repository (or --repository)")
    p.add_argument("--oci", type=Path, metavar="DIR", help="add the image to the OCI image layout DIR")
    p.add_argument("--docker-archive", type=Path, metavar="FILE", help="write a docker-archive tarball (podman load)")
    p.add_argument("--values", type=Path, metavar="FILE", help="write the image's Helm values (JSON) to FILE")
    add_chart_option(p)
    p.add_argument("--repository", help="destination repository instead of the image definition's")
    p.add_argument("--warm", type=Path, metavar="DIR",
                   help="bake the warm bundle `build.py warm` wrote in DIR as the top layer (refused when it "
                        "was made for other inputs; docs/WARM.md)")
    p.add_argument("--warm-from-cache", action="store_true",
                   help="bake the --cache-from build cache's warm entry of this build's warm key (written by a "
                        "build with --warm DIR --cache-to); none verifies: the build fails, nothing written")
    p.add_argument("--force", action="store_true", help="replace an existing --docker-archive file")
    p.add_argument("--sign-key", type=Path, metavar="PEM",
                   help="sign the provenance (DSSE) with this ECDSA P-256 or Ed25519 private key")
    p.add_argument("--cache-from", action="append", metavar="REGISTRY/REPO",
                   help="read the build cache entry of this build from REPO (repeatable, tried in order): "
                        "a verified hit neither pulls the base's vLLM layers nor patches nor compiles")
    p.add_argument("--cache-to", action="append", metavar="REGISTRY/REPO",
                   help="write this build's cache entry to REPO (repeatable; docs/ARCHITECTURE.md, Caches); "
                        "signed with --sign-key when given")
    p.add_argument("--cache-key", type=Path, metavar="PEM",
                   help="read only cache entries signed by this public key (an unsigned or mis-signed one is a miss); "
                        "required with the registries file's [cache] require_signed = true")

    p = _image_command(sub, "context", "write a build context for the Dockerfile (same files as build)", run_context)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the context directory to write")
    p.add_argument("--force", action="store_true", help="replace an existing build context in DIR")

    p = sub.add_parser("values", help="print the Helm values of an image already built and pushed")
    options.add_target_options(p)
    p.add_argument("--repository", help="the repository it was pushed to, instead of the image definition's")
    add_chart_option(p)
    options.add_registry_options(p)
    p.set_defaults(run=run_values)


def add_chart_option(parser) -> None:
    parser.add_argument("--chart", choices=CHARTS, default="kiln",
                        help="whose values: kiln's own (docs/HELM.md) or vLLM production-stack's vllm-stack chart "
                             "(default: %(default)s)")


def _image_command(sub, name: str, description: str, run):
    """A command that prepares one image: ``--image/--pin/--sm``, the base's registry, ``--json``."""
    p = sub.add_parser(name, help=description)
    options.add_target_options(p)
    options.add_base_image_options(p)
    p.add_argument("--without-unusable-kernels", action="store_true",
                   help="leave out the Triton kernel layer when the image's Triton could not use it (its Triton is "
                        "not the PyPI wheel kiln compiles with), instead of failing the build (docs/TRITON.md)")
    options.add_json_option(p)
    p.set_defaults(run=run)
    return p


def run_build_command(args, out) -> int:
    if args.chart != "kiln" and not args.values:
        raise KilnError(f"--chart {args.chart}: chooses the shape of --values FILE, which is not given")
    sign_key = load_signing_key(args.sign_key) if args.sign_key else None
    config = options.registry_config(args)
    cache_from, cache_to = _cache_locations(args, config)
    cache_key = load_public_key(args.cache_key) if args.cache_key else None
    if args.warm_from_cache and (args.warm or not cache_from):
        raise KilnError("--warm-from-cache: " + ("and --warm DIR name two warm caches: give one" if args.warm else
                        "no --cache-from REGISTRY/REPO (nor the registries file's [cache] from) to read it from"))
    if cache_from and cache_key is None and config.cache_require_signed:
        raise KilnError(f"{config.path}: cache.require_signed: reading the build cache "
                        f"({', '.join(loc.name for loc in cache_from)}) needs --cache-key PUB: "
                        "unsigned entries are refused")
    reporter = out.reporter()
    files = options.repo_files(args)
    # the catalogue's facts from the cache, when it has them: no patch module is imported unless
    # the build has to patch after all (kiln.patch.facts)
    cached = cached_catalogue(files.patchsets, cache_from, config, reporter, record_opener(cache_key))
    inputs = load_build_inputs(files, args.image, args.pin, args.sm, cached, args.platform)
    name = destination(inputs.definition, args.repository,
                       purpose="--push" if args.push else "--values" if args.values else "local")
    publishers: list[Publisher] = []
    if args.oci:
        publishers.append(LayoutPublisher(args.oci, inputs.tag, reporter))
    if args.docker_archive:
        publishers.append(ArchivePublisher(args.docker_archive, [f"{name.name}:{inputs.tag}"], args.force))
    if args.values:
        publishers.append(ValuesPublisher(args.values, name, args.chart, inputs.definition, inputs.pin))
    if args.push:
        publishers.append(RegistryPublisher(name, [inputs.tag], config, reporter))
    result = run_build(inputs, publishers, name.name, config, args.allow_unlocked, reporter=reporter,
                       leave_out_unusable_kernels=args.without_unusable_kernels, sign_key=sign_key,
                       cache_from=cache_from, cache_to=cache_to, cache_key=cache_key,
                       platforms=build_platforms(inputs, args.platform, args.docker_archive is not None),
                       warm=args.warm, warm_from_cache=args.warm_from_cache)
    result.warnings = list(reporter.warnings)
    if args.json:
        out.json(result.to_json())
        return 0
    where = ", ".join(result.outputs.values()) or "no output requested (digest only)"
    out.stdout.print(escape(
        f"built {result.repository}:{result.tag} {result.manifest_digest}\n"
        f"  base {result.base}@{result.base_digest}; layer {result.layer_digest} "
        f"({result.files_changed} file(s), {result.layer_size} bytes)\n"
        f"  pulled {result.bytes_pulled} bytes, pushed {result.bytes_pushed} bytes "
        f"in {result.timings.get('total', 0):.2f}s -> {where}"
    ))
    if "push" in result.outputs:
        print(result.manifest_digest)
    return 0


def build_platforms(inputs, asked: str | None, one: bool) -> tuple[str, ...]:
    """The tag's platforms: ``--platform``'s; else, for an output holding one platform
    (``--docker-archive``), the host's (``inputs.platform`` when the SM does not ship on it);
    else every platform the image ships the SM on (an OCI index of them when more than one)."""
    if asked:
        return (inputs.platform,)
    shipped = inputs.definition.platforms_of(inputs.sm)
    if one:
        return (host_platform(),) if host_platform() in shipped else (inputs.platform,)
    return tuple(shipped)


def _cache_locations(args, config) -> tuple[list, list]:
    """``--cache-from``/``--cache-to``, else the registries file's ``[cache] from``/``to``: checked now."""
    where = f"{config.path}: cache"
    found = []
    for option, name, listed in (("--cache-from", "from", args.cache_from), ("--cache-to", "to", args.cache_to)):
        texts, place = (listed, option) if listed else (getattr(config, f"cache_{name}"), f"{where}.{name}")
        found.append([parse_cache_location(text, place) for text in texts])
    return found[0], found[1]


def run_context(args, out) -> int:
    inputs = load_build_inputs(options.repo_files(args), args.image, args.pin, args.sm, platform=args.platform)
    publisher = ContextPublisher(args.out, args.force)
    result = run_build(inputs, [publisher], destination(inputs.definition, purpose="local").name,
                       options.registry_config(args), args.allow_unlocked, reporter=out.reporter(),
                       leave_out_unusable_kernels=args.without_unusable_kernels,
                       platforms=build_platforms(inputs, args.platform, one=True))
    record = publisher.record
    dest = publisher.path
    if args.json:
        out.json({**record, "out": str(dest), "timings": result.timings})
        return 0
    out.stdout.print(escape(
        f"wrote {dest}: {len(record['files'])} file(s), {len(record['removals'])} removal(s) over "
        f"{record['base']}\n  podman build $(sed 's/^/--build-arg=/' {dest}/build-args) "
        f"-t {inputs.definition.name}:{inputs.tag} {dest}"
    ))
    return 0


def run_values(args, out) -> int:
    inputs = load_build_inputs(options.repo_files(args), args.image, args.pin, args.sm, platform=args.platform)
    values = built_values(inputs, options.registry_config(args), args.repository, args.chart)
    sys.stdout.write(values_bytes(values).decode())
    return 0

