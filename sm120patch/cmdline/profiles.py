"""The commands about profiles, `list`, `show` and `new-patch`: their options, the verbs they
call (`sm120patch/commands/profiles.py`) and what each prints of its result."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import click

from sm120patch import render
from sm120patch.cmdline.options import complete_profile, json_option, session
from sm120patch.commands import profiles as verbs
from sm120patch.patchkit.kinds import TARGETS
from sm120patch.render import PATCH_WIDTH, Text, echo_out, emit_json, show

if TYPE_CHECKING:
    from sm120patch.plan.catalog import Catalog, Profile
    from sm120patch.plan.known import Entry

# ---- what each prints --------------------------------------------------------------------


def profiles_text(cat: Catalog, held: Mapping[str, list[str]] | None = None) -> Text:
    """`list`; `held`: per profile, why it is not recommended here (commands.profiles.held_here)."""
    from sm120patch.patchkit.versions import range_text

    text = Text()
    held = held or {}
    width = max([len(p.name) for p in cat.profiles.values()] + [8])
    for p in cat.profiles.values():
        pins = ", ".join(f"{k} {range_text(v)}" for k, v in p.pins.items())
        origin = cat.profile_sources[p.name]
        where = "" if origin.built_in else f" (from {origin.name})"
        status = f"{p.status}, not here" if held.get(p.name) else p.status
        text.out.append(f"{p.name:{width}} [{status}] {p.title}{where}")
        text.out.append(f"{'':{width}} pins: {pins}")
        if p.refuse:
            refused = ", ".join(f"{r.kind} {range_text(r.releases)}" for r in p.refuse)
            text.out.append(f"{'':{width}} refuses (unless --force): {refused}")
        for why in held.get(p.name, []):
            text.out.append(f"{'':{width}} not recommended here: {why}")
        for pid in p.patches:
            row = cat.patches.rows[pid]  # the registry's row: no patch module imported
            where = "" if row.pack.built_in else f" (from {row.pack.name})"
            text.out.append(f"{'':{width}}   {pid:{PATCH_WIDTH}} {row.title}{where}")
    return text


def profiles_doc(cat: Catalog, held: Mapping[str, list[str]] | None = None) -> dict[str, Any]:
    from sm120patch.patchkit.versions import range_text

    held = held or {}
    return {
        "profiles": [
            {
                "name": p.name,
                "title": p.title,
                "status": p.status,
                "patches": list(p.patches),
                "pins": {k: range_text(v) for k, v in p.pins.items()},
                "refuses": [
                    {"kind": r.kind, "releases": range_text(r.releases), "reason": r.reason}
                    for r in p.refuse
                ],
                "source": cat.profile_sources[p.name].name,
                "not_recommended_here": held.get(p.name, []),
            }
            for p in cat.profiles.values()
        ],
        "patches": [
            {"id": p.id, "target": p.target, "title": p.title, "source": p.pack.name}
            for p in cat.patches.rows.values()
        ],
    }


def profile_doc(cat: Catalog, prof: Profile, known: Sequence[Entry] = ()) -> dict[str, Any]:
    """`show --json`: the profile as `list --json` has it, its patches in full and every known
    outcome about it."""
    [doc] = [p for p in profiles_doc(cat)["profiles"] if p["name"] == prof.name]
    return {
        **doc,
        "known_text": " ".join(prof.known.split()) if prof.known else None,
        **prof.ran_doc(),
        "patches": [
            {
                "id": patch.id,
                "target": patch.target,
                "title": patch.title,
                "source": cat.source(patch.id).name,
                "why": patch.why,
                "upstream": patch.upstream or None,
                "shapes": [str(shape) for shape in patch.shapes],
            }
            for patch in cat.patches_of(prof)
        ],
        "known": [
            {
                "id": e.id,
                "outcome": e.outcome,
                "evidence": e.evidence,
                "figure": e.figure,
                "measured": e.measured or None,
                "condition": e.condition,
                "date": e.date,
                "source": e.source,
                **e.ran_doc(),
            }
            for e in known
        ],
    }


def profile_text(
    cat: Catalog, prof: Profile, known: Sequence[Entry] = (), width: int = 100
) -> Text:
    """`show PROFILE`: first the summary (what it is, pins, refusals, one line per patch and
    per known outcome), then the profile's notes, each patch in full, and every known outcome
    about it in full with its quote (what the one-line known outcomes of `apply` and `doctor`
    point to); wrapped at `width`."""
    from sm120patch.patchkit.versions import range_text
    from sm120patch.terminal import wrapped

    patches = cat.patches_of(prof)
    lines = [f"{prof.name} [{prof.status}]: {prof.title}"]
    lines += [f"  pinned on {k} {range_text(v)}" for k, v in prof.pins.items()]
    lines += [
        f"  refuses {r.kind} {r.releases} (--force to apply anyway): {r.reason}"
        for r in prof.refuse
    ]
    lines += [f"  patch {p.id}: {p.title}" for p in patches]
    lines += [f"  {e.line()}" for e in known]
    if prof.known:
        lines += ["", "About it: " + " ".join(prof.known.split())]
    lines += ["", prof.flag_sentence()] if prof.flag else []
    for patch in patches:
        lines.append("")
        lines.append(f"{patch.id} ({patch.target}, {cat.source(patch.id).name}): {patch.title}")
        lines.append("  why: " + patch.why)
        if patch.upstream:
            lines.append(f"  upstream: {patch.upstream}")
        if patch.wiring is not None:
            lines.append("  in the server log, ran: " + " | ".join(patch.wiring.ran))
            if patch.wiring.skipped:
                lines.append("  in the server log, skipped: " + " | ".join(patch.wiring.skipped))
        lines += [f"  - {shape}" for shape in patch.shapes]
    if known:
        lines += ["", f"Known outcomes about {prof.name}, in full:"]
        lines += [f"  {e.full()}" for e in known]
    return Text(out=[w for line in lines for w in wrapped(line, width)])


# ---- the commands ------------------------------------------------------------------------


@click.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """List the profiles and the patches they apply."""
    cat = verbs.list_profiles(session())
    held = verbs.held_here(cat)
    if as_json:
        emit_json(profiles_doc(cat, held))
        return
    show(profiles_text(cat, held))


@click.command("show")
@click.argument("profile", shell_complete=complete_profile)
@json_option
def show_cmd(profile: str, as_json: bool) -> None:
    """Show a profile: its pins, what it refuses, its patches (why each exists, the shapes each
    knows) and every known outcome about it, in full."""
    s = session()
    prof = verbs.show(s, profile)
    entries = verbs.known_about(profile, s.catalog)
    if as_json:
        emit_json(profile_doc(s.catalog, prof, entries))
        return
    show(profile_text(s.catalog, prof, entries, render.page_width()))


@click.command("new-patch")
@click.argument("patch_id")
@click.option("--target", type=click.Choice([str(k) for k in TARGETS]), required=True)
@click.option(
    "--file",
    "rel",
    required=True,
    metavar="PATH",
    help="The file holding the site, relative to the package's parent.",
)
@click.option("--function", required=True, help="The function holding the site.")
@click.option("--pins", required=True, metavar="SPEC", help="Releases the profile pins.")
@click.option("--keyword", default=None, help="A list keyword to extend (with --expect, --add).")
@click.option("--expect", default=None, metavar="N,N", help="The list as released, e.g. 9,10.")
@click.option("--add", type=int, default=None, help="The element to add, e.g. 12.")
@click.option("--profile", default=None, help="Profile name (default: the id's last part).")
@click.option(
    "--dir",
    "directory",
    default="sm120patch-pack",
    show_default=True,
    type=click.Path(file_okay=False),
    help="The pack directory to write into.",
)
@click.option("--force", is_flag=True, help="Overwrite files new-patch wrote before.")
def new_patch_cmd(**options: Any) -> None:
    """Write a patch module, its facts table, a profile and a test into a pack directory."""
    written = verbs.new_patch(verbs.NewPatchRequest(**options))
    for path in (written.module, written.test, written.profiles, written.registry):
        if path is None:
            continue
        echo_out(f"wrote {path}")
    directory = options["directory"]
    for line in render.hint_lines(
        f"fill in the TODOs, then `python -m pytest {shlex.quote(str(written.test))}` and "
        f"`sm120patch --patches {shlex.quote(directory)} apply {written.profile} --dry-run`"
    ):
        echo_out(line.strip())
