"""``build.py plan``: the (image, pin, SM) builds a change needs, as a GitHub Actions matrix."""

from __future__ import annotations

import json

from kiln.commands.options import repo_files
from kiln.plan import Build, Layout, plan_builds


def register(sub) -> None:
    p = sub.add_parser("plan", help="the (image, pin, SM) builds a change needs, as a JSON matrix")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--since", metavar="REV", help="compare HEAD (or the work tree) with this commit")
    which.add_argument("--all", action="store_true", help="every image x pin x SM")
    p.add_argument("--include-worktree", action="store_true",
                   help="plan from the work tree (uncommitted and untracked files) instead of HEAD")
    p.set_defaults(run=run_plan)


def run_plan(args, out) -> int:
    files = repo_files(args)
    layout = Layout.discover(files.pins, files.patchsets, files.images, files.record)
    plan = plan_builds(layout, None if args.all else args.since, args.include_worktree)
    # stdout is the matrix alone (one line, for $GITHUB_OUTPUT); the why goes to stderr
    print(json.dumps(plan.matrix(), separators=(",", ":")))
    since = plan.since[:12] if plan.since else "nothing (--all)"
    head = plan.head[:12] if plan.head != "worktree" else "the work tree"
    err = out.stderr
    err.print(f"plan: {len(plan.builds)} build(s) from {since} to {head}", highlight=False)
    for path, kind in plan.changes.items():
        err.print(f"  {kind:<6} {path}", highlight=False, markup=False)
    groups: dict[tuple[str, str], list[Build]] = {}
    for build in plan.builds:
        groups.setdefault((build.image, build.pin), []).append(build)
    for (image, pin), builds in groups.items():
        sms = ",".join(str(b.sm) for b in builds)
        why = "; ".join(plan.reasons[builds[0]])
        err.print(f"  build {image} {pin} sm {sms}: {why}", highlight=False, markup=False)
    return 0
