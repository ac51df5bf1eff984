"""``build.py check REF [--key PUB]``: verify an image's attestations and re-derive it bit for bit."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from kiln.attest import Refused
from kiln.attest.dsse import load_public_key
from kiln.attest.recheck import check_image
from kiln.commands import options
from kiln.secrets import scrub


def register(sub) -> None:
    p = sub.add_parser("check", help="verify an image's signed provenance and SBOM, rebuild it, compare")
    p.add_argument("reference", metavar="REF", help="the image: REGISTRY/REPOSITORY:TAG or @sha256:…")
    p.add_argument("--key", type=Path, metavar="PUB",
                   help="PEM public key the provenance must be signed with (without it: not verified)")
    p.add_argument("--allow-moved-tag", action="store_true",
                   help="check the image REF's tag names even when its provenance records another tag "
                        "(a warning; without it such a moved tag is refused)")
    options.add_registry_options(p)
    options.add_limit_options(p)
    options.add_json_option(p)
    p.set_defaults(run=run_check)


def run_check(args, out) -> int:
    key = load_public_key(args.key) if args.key else None
    reporter = out.reporter()
    try:
        result = check_image(args.reference, options.repo_files(args), options.registry_config(args), key,
                             reporter, allow_moved_tag=args.allow_moved_tag)
    except Refused as err:
        if args.json:
            out.json({"reference": args.reference, "identical": False, "refused": str(err)})
        else:
            out.stderr.print(f"[red]refused:[/] {escape(scrub(str(err)))}", soft_wrap=True)
        return 1
    if args.json:
        out.json({"reference": result.reference, "digest": result.digest, "tag": result.tag,
                  "platform": result.platform, "signed_by": result.signed_by,
                  "identical": result.identical, "difference": result.difference, "warm": result.warm or None})
    elif result.identical:
        signer = f"signed by key {result.signed_by}" if result.signed_by else "signature not verified"
        out.stdout.print(escape(f"identical: {result.reference} ({result.digest}), tag {result.tag}, "
                                f"{result.platform}, {signer}"), soft_wrap=True)
        if result.warm:
            out.stdout.print(escape(_warm_line(result)), soft_wrap=True)
    else:
        out.stderr.print(f"[red]refused:[/] {escape(scrub(f'{result.digest} {result.difference}'))}", soft_wrap=True)
    return 0 if result.identical else 1


def _warm_line(result) -> str:
    """What ``check`` did with the warm layer: not re-derived, verified by digest (and by signature with --key)."""
    why = "not re-derived: compile output is not bit-reproducible across hosts"
    if result.signed_by:
        return (f"warm layer {result.warm}: verified by the digest the provenance records and its signature "
                f"(key {result.signed_by}); {why}")
    return (f"warm layer {result.warm}: the digest the provenance records, but its signature is not verified "
            f"(no --key), so neither is the warm layer; {why}")
