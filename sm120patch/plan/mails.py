"""The mail-format patches `export` writes: one per applied patch per target, for `git am` or
`git apply` on another checkout of the same release (or `patch -p1` in an image build)."""

from __future__ import annotations

import email.utils
from dataclasses import dataclass
from pathlib import Path

from sm120patch import __version__
from sm120patch.errors import Refused
from sm120patch.patchkit.model import TARGETS, Patch
from sm120patch.plan.diffs import diff_texts
from sm120patch.plan.plans import Plan
from sm120patch.targets import files

AUTHOR = "sm120patch <sm120patch@localhost>"


@dataclass(frozen=True)
class MailFile:
    target: str
    patch: str
    path: Path


def mails(plan: Plan) -> dict[str, list[tuple[str, str]]]:
    """Per target kind, (patch id, mail text) in profile order."""
    cat = plan.catalog
    order = {pid: i for i, pid in enumerate(plan.profile.patches)}
    out: dict[str, list[tuple[str, str]]] = {}
    for tp in plan.targets:
        steps = []
        for f in tp.changed:
            before = f.before
            for pid, text in f.step_texts():
                steps.append((order[pid], pid, diff_texts(tp.target.rel(f.file), before, text)))
                before = text
        steps.sort(key=lambda s: s[0])
        total = len(steps)
        mails_of_target = []
        for n, (_, pid, diff) in enumerate(steps, start=1):
            patch = cat.patches[pid]
            mails_of_target.append((pid, _mail(n, total, plan.profile.name, patch, diff)))
        if mails_of_target:
            out[tp.target.kind] = mails_of_target
    return out


def _mail(n: int, total: int, profile: str, patch: Patch, diff: str) -> str:
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        f"From: {AUTHOR}\n"
        f"Date: {email.utils.formatdate(localtime=False)}\n"
        f"Subject: [PATCH {n}/{total}] sm120patch: {patch.title}\n"
        "\n"
        f"{patch.why}\n"
        "\n"
        f"Sm120patch-Patch: {patch.id}\n"
        f"Sm120patch-Profile: {profile}\n"
        f"Sm120patch-Version: {__version__}\n"
        "---\n"
        f"{diff}"
        "-- \n"
        f"sm120patch {__version__}\n"
        "\n"
    )


def write_mails(plan: Plan, out_dir: Path, *, overwrite: bool = False) -> list[MailFile]:
    """Write the series; a DIR that already holds files is refused unless `overwrite`: an old
    series left beside a new one would be applied with it by `git am DIR/*/*.patch`."""
    found = mails(plan)
    if not found:
        raise Refused(
            f"nothing to export: profile {plan.profile.name} changes no file here (every "
            "site is already SM120-ready in these releases)",
            "`sm120patch apply " + plan.profile.name + " --dry-run` shows each site's outcome",
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise Refused(f"{out_dir} is a file, not a directory", "give -o a directory")
    for each in TARGETS:
        if (out_dir / each).is_symlink():
            # Neither written nor emptied through a link: it may lead anywhere.
            raise Refused(
                f"{out_dir / each} is a symbolic link; export writes and deletes nothing "
                "through one",
                f"remove the link {out_dir / each}, or give -o another directory",
            )
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise Refused(
                f"{out_dir} is not empty; an old series there would be applied with the new one",
                f"give -o an empty or new directory, or --overwrite to replace {out_dir}'s "
                "patches",
            )
        if out_dir.is_symlink():
            raise Refused(
                f"{out_dir} is a symbolic link; --overwrite deletes nothing through one",
                f"give -o the directory it points to ({out_dir.resolve()})",
            )
        for each in TARGETS:
            files.remove_entries(out_dir / each, "*.patch")
    written = []
    for kind, items in found.items():
        directory = out_dir / kind
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise files.output_error(directory, exc, "cannot create") from None
        for n, (pid, text) in enumerate(items, start=1):
            path = directory / f"{n:04d}-{pid.replace('.', '-')}.patch"
            files.write_output(path, text)
            written.append(MailFile(kind, pid, path))
    return written
