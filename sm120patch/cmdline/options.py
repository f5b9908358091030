"""What the commands of every family share: the target options (`with_targets`), --json, the
profile's shell completion, and the command's session (`session`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click

from sm120patch import app, render
from sm120patch.patchkit.kinds import DISPLAY, LOOKED_FOR, TARGETS

F = TypeVar("F", bound=Callable[..., Any])


def _target_options() -> list[Callable[[F], F]]:
    """One `--KIND PATH` per kind of the kinds table, then one `--KIND-version VERSION` each:
    a new kind of target is a row there, and every command on targets takes it."""
    paths = [
        click.option(
            f"--{kind}",
            f"path_{kind.name.lower()}",
            metavar="PATH",
            default=None,
            help=f"{DISPLAY[kind]} checkout root, package parent or site-packages "
            + (
                "(default: the one installed in this Python)."
                if kind in LOOKED_FOR
                else "(looked for only when given)."
            ),
        )
        for kind in TARGETS
    ]
    versions = [
        click.option(
            f"--{kind}-version",
            f"version_{kind.name.lower()}",
            metavar="VERSION",
            default=None,
            help=f"The {DISPLAY[kind]} release this tree is, where its packaging does not say.",
        )
        for kind in TARGETS
    ]
    return [*paths, *versions]


target_options = _target_options()


def with_targets(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The command takes the target options, and gets what they name as one `app.Named`,
    its `targets` argument."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        paths = {kind.value: kwargs.pop(f"path_{kind.name.lower()}") for kind in TARGETS}
        versions = {kind.value: kwargs.pop(f"version_{kind.name.lower()}") for kind in TARGETS}
        named = app.Named(paths, {kind: v for kind, v in versions.items() if v})
        return fn(*args, targets=named, **kwargs)

    for option in reversed(target_options):
        command = option(command)
    return command


json_option = click.option(
    "--json", "as_json", is_flag=True, callback=render.remember_json, help="Print JSON for scripts."
)

locked_option = click.option(
    "--locked",
    "locked",
    metavar="LOCKFILE",
    type=click.Path(dir_okay=False),
    help="Exactly what this lock file (from `pin`) records, or refuse.",
)

verbose_option = click.option(
    "-v", "--verbose", is_flag=True, help="The known outcomes in full, not one line each."
)


def complete_profile(ctx: click.Context, param: object, incomplete: str) -> list[Any]:
    """Shell completion of PROFILE: the profile names, the packs' (--patches) included."""
    from click.shell_completion import CompletionItem

    from sm120patch.commands import profiles

    packs = tuple(ctx.find_root().params.get("pack_dirs") or ())
    return [CompletionItem(n) for n in profiles.profile_names(packs) if n.startswith(incomplete)]


def session(targets: app.Named | None = None, *, verbose: bool = False) -> app.Session:
    """The command's session: the targets it names and the group's --patches, held where a
    hint reads what to paste (render.paste)."""
    held = render.invocation(click.get_current_context())
    named = targets or app.Named()
    made = app.Session(paths=named.paths, packs=held.packs, stated=named.stated, verbose=verbose)
    # Closed with the command's context, at its end: no descriptor outlives the command.
    held.session = click.get_current_context().with_resource(made)
    return held.session
