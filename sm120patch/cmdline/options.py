"""What the commands of every family share: the target options (`with_targets`), --json, the
profile's shell completion, and the command's session (`session`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from sm120patch import app, render

F = TypeVar("F", bound=Callable[..., Any])


def _stated(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:  # --sglang-version / --flashinfer-version, for `session` (checked there)
        ctx.meta.setdefault("sm120patch.stated", {})[str(param.name)[: -len("_version")]] = value


VLLM_META = "sm120patch.vllm"


def _named_vllm(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # Not a parameter of every command: `session` reads it, as it reads the stated versions.
    if value:
        ctx.find_root().meta[VLLM_META] = value


target_options = [
    click.option(
        "--sglang",
        "sglang",
        metavar="PATH",
        default=None,
        help="SGLang checkout root, package parent or site-packages "
        "(default: the one installed in this Python).",
    ),
    click.option(
        "--flashinfer",
        "flashinfer",
        metavar="PATH",
        default=None,
        help="FlashInfer checkout root, package parent or site-packages "
        "(default: the one installed in this Python).",
    ),
    click.option(
        "--vllm",
        metavar="PATH",
        expose_value=False,
        callback=_named_vllm,
        help="vLLM checkout root, package parent or site-packages (looked for only when given).",
    ),
    *(
        click.option(
            f"--{k}-version",
            metavar="VERSION",
            expose_value=False,
            callback=_stated,
            help=f"The {n} release this tree is, where its packaging does not say.",
        )
        for k, n in (("sglang", "SGLang"), ("flashinfer", "FlashInfer"), ("vllm", "vLLM"))
    ),
]


def with_targets(fn: F) -> F:
    for option in reversed(target_options):
        fn = option(fn)
    return fn


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


def session(
    sglang: str | None = None, flashinfer: str | None = None, *, verbose: bool = False
) -> app.Session:
    """The command's session: its targets and the group's --patches."""
    root = click.get_current_context().find_root()
    vllm = root.meta.get(VLLM_META)
    # hints use them
    root.meta[render.PATHS_META] = {
        "sglang": sglang,
        "flashinfer": flashinfer,
        **({"vllm": vllm} if vllm else {}),
    }
    return app.Session(
        sglang,
        flashinfer,
        root.obj or (),
        root.meta.get("sm120patch.stated", {}),
        verbose=verbose,
        vllm=vllm,
    )
