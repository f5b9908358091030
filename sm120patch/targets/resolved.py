"""The targets of one command, each found once (`Resolved`).

A command names its targets (`--sglang`, `--flashinfer`, `--vllm`), or, naming none, gets the
documented defaults (the one importable by this Python). A command that names any target never
takes another from this Python: a kind it does not name is the one beside a named installed
target (the FlashInfer in an installed SGLang's site-packages), else a refusal asking for it.
`app.Session` holds one `Resolved` and hands it to every verb, so that a target is found, its
version read and its checkout's git asked, once per command, and every step of the command
works on the same `Target` (the same tree, whatever is renamed under its path meanwhile). A
target that could not be found is the same refusal each time it is asked for, never a second
search. A vLLM is looked for only where the command names it (`kinds.LOOKED_FOR`).

A `Resolved` carries the command's `Config` (`config`): the versions it states are part of
finding a target, and the verbs, which are given this object, load the catalog of its packs
(`catalog.load(named.config)`), so a command's packs and versions reach every step of it
without a process-wide setting.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TypeAlias

from sm120patch.config import Config
from sm120patch.errors import AGAIN, Refused, Sm120Error
from sm120patch.patchkit.kinds import DISPLAY, LOOKED_FOR
from sm120patch.targets import KINDS, Target, finding

Paths: TypeAlias = Mapping[str, str | Path | None]


class Resolved:
    """The targets a command names, found on first use and kept: `find` (the target of a kind,
    at its path or the default), `quiet` (None where it is not there and was not named), `at`
    (the one in a directory: the FlashInfer beside an installed SGLang)."""

    def __init__(self, paths: Paths, config: Config | None = None) -> None:
        self.config = config or Config.made()  # none given: the environment's packs alone
        self.paths: dict[str, str | Path | None] = {k: paths.get(k) for k in KINDS}
        self._named: dict[str, Target | Sm120Error] = {}
        self._in: dict[tuple[str, Path], Target | Sm120Error] = {}

    def close(self) -> None:
        """Close the handle of every target found (`Target.handle`): at the command's end,
        by whoever made this (`app.Session`, `owned`); a target is not used after it."""
        for held in (*self._named.values(), *self._in.values()):
            if isinstance(held, Target):
                held.handle.close()

    def __enter__(self) -> Resolved:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def given(self, kind: str) -> bool:
        """Whether the command line names a path for `kind`."""
        return self.paths.get(kind) is not None

    def find(self, kind: str) -> Target:
        """The target of `kind` at its path, or the one installed in this Python (its refusal
        when there is none, raised again each time). A kind looked for only when named (vLLM)
        and not named is a refusal, whatever this Python has installed: a profile that
        patches vLLM never patches one the command line did not name."""
        if kind not in self._named and not (self.given(kind) or kind in LOOKED_FOR):
            self._named[kind] = not_named(kind)
        if kind not in self._named and not self.given(kind) and self.named_any():
            self._named[kind] = self._beside_named(kind)
        if kind not in self._named:
            try:
                self._named[kind] = self._find(kind, self.paths.get(kind))
            except Sm120Error as exc:
                self._named[kind] = exc
        return _held(self._named[kind])

    def _find(self, kind: str, path: str | Path | None) -> Target:
        return finding.find(kind, path, self.config.stated.get(kind))

    def named_any(self) -> bool:
        """Whether the command line names a path for any kind: then nothing is looked for in
        this Python (the tool's own environment), only at or beside what was named."""
        return any(self.given(k) for k in KINDS)

    def _beside_named(self, kind: str) -> Target | Sm120Error:
        """The `kind` target in the site-packages of a named installed target (the FlashInfer
        an installed SGLang runs with), else the refusal that asks for it by name: a command
        that names its targets never reaches the tool's own environment for another."""
        named = [k for k in KINDS if self.given(k)]
        where = []
        for other in named:
            try:
                found = self.find(other)
            except Sm120Error:
                where.append(f"--{other} {self.paths[other]}")
                continue
            where.append(f"the {found.name} at {found.root}")
            if found.layout != "git" and (found.parent / kind).is_dir():
                try:
                    return self.at(kind, found.parent)
                except Sm120Error as exc:
                    return exc
        return beside_missing(kind, where)

    def quiet(self, kind: str, *, required: bool | None = None) -> Target | None:
        """`find`, or None when `kind` is not there and (unless `required`) was not named; a
        kind not looked for by default (vLLM) is not there unless named or `required`."""
        if not (required or self.given(kind) or kind in LOOKED_FOR):
            return None
        try:
            return self.find(kind)
        except Refused:
            if self.given(kind) if required is None else required:
                raise
            return None

    def each(self, kinds: tuple[str, ...] = KINDS) -> list[Target]:
        """The targets of `kinds` that are there (`quiet`), in order."""
        return [t for t in (self.quiet(k) for k in kinds) if t is not None]

    def at(self, kind: str, directory: Path) -> Target:
        """The target of `kind` in `directory` (a site-packages): one already found there is
        the same target, not a second finding of it."""
        where = directory.resolve()
        for held in (*self._named.values(), *self._in.values()):
            if isinstance(held, Target) and held.kind == kind and held.package_dir == where / kind:
                return held
        if (kind, where) not in self._in:
            try:
                self._in[kind, where] = self._find(kind, where)
            except Sm120Error as exc:
                self._in[kind, where] = exc
        return _held(self._in[kind, where])


Given: TypeAlias = Resolved | Paths


def resolved(given: Given) -> Resolved:
    """`given` as a `Resolved`: a command's own, or one for paths (kind -> path) given by a
    caller that holds none (a test, a library user), with the environment's configuration."""
    return given if isinstance(given, Resolved) else Resolved(given)


@contextmanager
def owned(given: Given) -> Iterator[Resolved]:
    """`resolved(given)` for the block: one made here for paths is closed at its end (the
    handles of the targets it found); a command's own is its owner's to close (`app.Session`).
    A verb a caller may give paths to runs in one of these, so no descriptor outlives it."""
    if isinstance(given, Resolved):
        yield given
        return
    with Resolved(given) as named:
        yield named


def not_named(kind: str) -> Refused:
    """The refusal of a kind looked for only when named (vLLM), which the command needs and
    does not name. Its hint pastes: the command again with `--KIND` and the one installed in
    this Python, where there is one (found by `find_spec`, nothing of it imported or read);
    else the command that prints where the server's Python has it."""
    import importlib.util
    import shlex

    name = DISPLAY[kind]
    message = f"{name} is looked for only where the command names it, and this one does not"
    spec = importlib.util.find_spec(kind)
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    if places:
        parent = Path(places[0]).resolve().parent
        hint = f"`sm120patch {AGAIN} --{kind} {shlex.quote(str(parent))}` ({name} in this Python)"
    else:
        probe = f"import {kind}, pathlib; print(pathlib.Path({kind}.__file__).parents[1])"
        hint = (
            f"`python3 -c {shlex.quote(probe)}` in the server's Python prints the directory "
            f"holding its {name}: give it as --{kind}"
        )
    return Refused(message, hint)


def beside_missing(kind: str, named: list[str]) -> Refused:
    """The refusal of a `kind` target needed beside named ones that hold none: the command
    names its targets, so this Python's own is not taken in its place."""
    import shlex

    name = DISPLAY[kind]
    probe = f"import {kind}, pathlib; print(pathlib.Path({kind}.__file__).parents[1])"
    return Refused(
        f"no {name} beside {', '.join(named)}, and this command names its targets, so the "
        f"{name} of sm120patch's own Python is not used; name the one the server runs with",
        f"`python3 -c {shlex.quote(probe)}` in the server's Python prints the directory "
        f"holding its {name}: give it as --{kind}, `sm120patch {AGAIN} --{kind} DIR`",
    )


def _held(found: Target | Sm120Error) -> Target:
    if isinstance(found, Sm120Error):
        raise found
    return found
