"""Assemble a serve bundle (``ci/gpu_serve_bundle.py``) on the GPU machine. Standard library only.

    python3 ci/gpu_serve_assemble.py --receive PART --manifest MANIFEST --into PARTS_DIR   # one per run
    python3 ci/gpu_serve_assemble.py --assemble PARTS_DIR --prefix PREFIX [--opt-kiln /opt/kiln]

``--receive``: checks one part against the manifest (name, size, sha256) and copies it into
PARTS_DIR (kept between runs while the machine is up), with the manifest; says which parts are
still missing. ``--assemble``: every part's sha256 again, the parts joined into one tar whose
sha256 must be the manifest's, the tar unpacked (no member outside PREFIX/bundle, no link), every
file checked against ``bundle.json``, then:

- ``python -m pip install --no-index --no-deps --target PREFIX/site`` of the bundle's wheels
  (vLLM and the requirements the machine lacks): the pristine install;
- ``PREFIX/patched/vllm``: a tree of links to ``PREFIX/site/vllm`` in which the files kiln's
  patched layer changes are kiln's (``/opt/kiln/manifest.json`` of the layer: each changed file's
  ``before`` sha256 checked on the installed vLLM, its ``after`` on the overlay's copy);
- kiln's ``/opt/kiln`` files (the audit file, the chat template, the Triton kernel cache) under
  ``--opt-kiln`` (default ``PREFIX/opt-kiln``; ``/opt/kiln`` on the GPU machine, where the kernel
  cache's group files name their paths);
- ``PREFIX/assembled.json``: what was done, and the environment for each side:
  pristine ``PYTHONPATH=PREFIX/site``; patched ``PYTHONPATH=PREFIX/patched:PREFIX/site``.

Every failure is one line naming the file at fault, exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

FORMAT = 1


class Refused(Exception):
    pass


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise Refused(f"{path}: not a readable manifest ({err})") from None
    if manifest.get("format") != FORMAT or not manifest.get("parts"):
        raise Refused(f"{path}: not a serve-bundle manifest of format {FORMAT}")
    return manifest


def check_part(path: Path, entry: dict) -> None:
    if not path.is_file():
        raise Refused(f"{path}: missing")
    size = path.stat().st_size
    if size != entry["size"]:
        raise Refused(f"{path}: {size} bytes, the manifest says {entry['size']}")
    if sha256_file(path) != entry["sha256"]:
        raise Refused(f"{path}: sha256 differs from the manifest's")


def receive(part: Path, manifest_path: Path, into: Path) -> list[str]:
    manifest = load_manifest(manifest_path)
    entry = next((p for p in manifest["parts"] if p["name"] == part.name), None)
    if entry is None:
        raise Refused(f"{part}: not a part the manifest {manifest_path} lists")
    check_part(part, entry)
    into.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(manifest_path, into / "manifest.json")
    tmp = into / f".{part.name}.tmp"
    shutil.copyfile(part, tmp)
    os.replace(tmp, into / part.name)
    return [p["name"] for p in manifest["parts"] if not (into / p["name"]).is_file()]


def join_parts(parts: Path, manifest: dict, out: Path) -> None:
    digest = hashlib.sha256()
    with open(out, "wb") as joined:
        for entry in manifest["parts"]:
            path = parts / entry["name"]
            check_part(path, entry)
            with open(path, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(chunk)
                    joined.write(chunk)
    if digest.hexdigest() != manifest["bundle_sha256"]:
        raise Refused(f"{out}: the joined parts' sha256 differs from the manifest's bundle_sha256")


def unpack(tar_path: Path, dest: Path) -> None:
    root = dest.resolve()
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            target = (dest / member.name).resolve()
            if not (member.isfile() or member.isdir()) or not target.is_relative_to(root):
                raise Refused(f"{tar_path}: member {member.name!r} is not a plain file or folder inside the bundle")
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)


def check_files(bundle: Path, listed: dict) -> None:
    on_disk = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()} - {"bundle.json"}
    extra = sorted(on_disk - set(listed))
    if extra:
        raise Refused(f"{bundle / extra[0]}: not listed in bundle.json")
    for rel, sha in sorted(listed.items()):
        path = bundle / rel
        if not path.is_file():
            raise Refused(f"{path}: listed in bundle.json, missing")
        if sha256_file(path) != sha:
            raise Refused(f"{path}: sha256 differs from bundle.json's")


def pip_install(python: str, wheels: list[Path], site: Path) -> None:
    command = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--disable-pip-version-check", "--target", str(site), *map(str, wheels)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise Refused(f"pip install --no-index --no-deps into {site} failed: {last}")


def overlay(prefix: Path, bundle: Path, site_name: str) -> dict:
    """PREFIX/patched/vllm: links to the installed vLLM, kiln's changed files copied in, all checked."""
    audit_path = bundle / "overlay" / "opt" / "kiln" / "manifest.json"
    audit = json.loads(audit_path.read_text())
    site, patched = prefix / "site", prefix / "patched"
    lead = f"/{site_name}/vllm/"
    if patched.exists():
        shutil.rmtree(patched)
    shutil.copytree(site / "vllm", patched / "vllm", symlinks=True, copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    changed = []
    for path, sums in sorted(audit["files"].items()):
        if not path.startswith(lead):
            raise Refused(f"{audit_path}: {path} is not under {lead}")
        rel = path[len(lead):]
        installed = site / "vllm" / rel
        if sums["before"] is None:
            if installed.exists():
                raise Refused(f"{installed}: kiln's manifest says the patch adds it, but the install has one")
        elif not installed.is_file() or sha256_file(installed) != sums["before"]:
            raise Refused(f"{installed}: not the pristine file kiln patched (before sha256 {sums['before'][:12]})")
        source = bundle / "overlay" / site_name / "vllm" / rel
        if sha256_file(source) != sums["after"]:
            raise Refused(f"{source}: sha256 differs from kiln's manifest (after {sums['after'][:12]})")
        target = patched / "vllm" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        shutil.copyfile(source, target)
        if sha256_file(target) != sums["after"]:
            raise Refused(f"{target}: sha256 differs from kiln's manifest after the copy")
        changed.append(rel)
    return {"changed": changed, "patches": [p["patch"] for p in audit["patches"] if p["verdict"] == "APPLIES"]}


def install_opt_kiln(bundle: Path, opt_kiln: Path) -> list[str]:
    placed = []
    for layer in ("overlay", "kernels"):
        source = bundle / layer / "opt" / "kiln"
        for path in sorted(source.rglob("*")):
            if path.is_file():
                rel = path.relative_to(source)
                target = opt_kiln / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
                placed.append(rel.as_posix())
    return placed


def assemble(parts: Path, prefix: Path, opt_kiln: Path | None, python: str) -> dict:
    manifest = load_manifest(parts / "manifest.json")
    prefix.mkdir(parents=True, exist_ok=True)
    tar_path = prefix / "bundle.tar"
    join_parts(parts, manifest, tar_path)
    bundle = prefix / "bundle"
    if bundle.exists():
        shutil.rmtree(bundle)
    unpack(tar_path, bundle)
    tar_path.unlink()
    listing = json.loads((bundle / "bundle.json").read_text())
    check_files(bundle, listing["files"])
    probe = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != listing["python"]:
        raise Refused(f"{bundle / 'bundle.json'}: built for Python {listing['python']}, "
                      f"but {python} is {probe.stdout.strip() or 'not runnable'}")
    site = prefix / "site"
    if site.exists():
        shutil.rmtree(site)
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    pip_install(python, wheels, site)
    laid = overlay(prefix, bundle, listing["site"])
    opt_kiln = opt_kiln or prefix / "opt-kiln"
    placed = install_opt_kiln(bundle, opt_kiln)
    done = {"prefix": str(prefix), "wheels": len(wheels), "overlay": laid, "opt_kiln": str(opt_kiln),
            "opt_kiln_files": len(placed), "model": str(bundle / "model"),
            "env": {"pristine": {"PYTHONPATH": str(site)},
                    "patched": {"PYTHONPATH": os.pathsep.join([str(prefix / "patched"), str(site)])},
                    "TRITON_CACHE_DIR": str(opt_kiln / "triton-cache")}}
    (prefix / "assembled.json").write_text(json.dumps(done, indent=1) + "\n")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--receive", type=Path, metavar="PART")
    parser.add_argument("--manifest", type=Path, help="with --receive: the bundle's manifest.json")
    parser.add_argument("--into", type=Path, help="with --receive: where the parts are gathered")
    parser.add_argument("--assemble", type=Path, metavar="PARTS_DIR")
    parser.add_argument("--prefix", type=Path, help="with --assemble: where to install")
    parser.add_argument("--opt-kiln", type=Path, help="with --assemble: where kiln's /opt/kiln files go")
    parser.add_argument("--python", default=sys.executable, help="the Python whose pip installs (default: this one)")
    args = parser.parse_args(argv)
    try:
        if args.receive:
            if not (args.manifest and args.into):
                raise Refused("--receive needs --manifest and --into")
            missing = receive(args.receive, args.manifest, args.into)
            print(f"gpu_serve_assemble: {args.receive.name} received; "
                  + (f"missing: {' '.join(missing)}" if missing else "all parts here"))
        elif args.assemble:
            if not args.prefix:
                raise Refused("--assemble needs --prefix")
            print(json.dumps(assemble(args.assemble, args.prefix, args.opt_kiln, args.python), indent=1))
        else:
            raise Refused("give --receive PART or --assemble PARTS_DIR")
    except Refused as err:
        print(f"gpu_serve_assemble: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"gpu_serve_assemble: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
