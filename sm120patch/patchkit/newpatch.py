"""`sm120patch new-patch ID`: write a patch module, its test and a profile into a patch pack
directory, the way `alembic revision` writes a revision script to fill in.

The module and the test are rendered from the templates shipped beside this module
(`templates/*.tmpl`, package data): `patch.py.tmpl` holds every declaration of a patch (find and
operation, facts, wiring, the explain reader, the real tier's check), with the transform from
`transform-keyword.py.tmpl` or `transform-todo.py.tmpl`; `test_patch.py.tmpl` its test. With
`--keyword`, `--expect` and `--add` the module is complete: one `extend_keyword_list` operation
(`f(..., supported_major_versions=[10])` -> `[10, 12]` in one named function). Without them its
transform refuses until written, and so does its test. Everything is written through the
caller's writer (the files module's `write_output`).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from sm120patch.errors import UsageError
from sm120patch.patchkit.model import TARGETS
from sm120patch.safeio import read_named

ID_RE = re.compile(r"^[a-z][a-z0-9]*(?:[.-][a-z0-9]+)+$")
# What new-patch writes into Python and TOML is checked against these before anything is
# rendered, and rendered escaped all the same: a quote in a name must not end a string literal
# of the module a root `--patches` run imports.
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # a Python identifier (ASCII)
FILE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:/[A-Za-z_][A-Za-z0-9_]*)*\.py$")
PROFILE_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")  # as the library's profiles are named
# The module's title, and its registry row's where the directory has a registry.toml: the
# catalog holds the module to its row, so both change together.
TITLE = "TODO: one line saying what the patch changes"


@dataclass(frozen=True)
class NewPatch:
    patch_id: str
    target: str
    file: str  # relative to the package's parent, e.g. flashinfer/jit/comm.py
    function: str
    pins: str
    profile: str = ""  # default: the id's last part
    keyword: str | None = None
    expect: tuple[int, ...] = ()
    add: int | None = None

    @property
    def module_name(self) -> str:
        return re.sub(r"[.-]", "_", self.patch_id)

    @property
    def profile_name(self) -> str:
        return self.profile or self.patch_id.split(".")[-1]

    @property
    def complete(self) -> bool:
        return self.keyword is not None and bool(self.expect) and self.add is not None


@dataclass(frozen=True)
class Written:
    module: Path
    test: Path
    profiles: Path
    profile: str
    registry: Path | None = None  # the registry.toml given the patch's row, where there is one


def check(spec: NewPatch) -> None:
    if not ID_RE.match(spec.patch_id):
        raise UsageError(
            f"patch id '{spec.patch_id}' is not like 'flashinfer.moe-arch'",
            "use lower-case words joined by dots and dashes, the target first",
        )
    if spec.target not in TARGETS:
        raise UsageError(
            f"target '{spec.target}' is not one of {', '.join(TARGETS)}",
            "--target names the package the site is in",
        )
    if not NAME_RE.match(spec.function):
        raise UsageError(
            f"{spec.function!r} is not a function name",
            "--function takes the name of the function holding the site, e.g. gen_comm_module",
        )
    if not FILE_RE.match(spec.file) or spec.file.split("/")[0] != spec.target:
        raise UsageError(
            f"--file {spec.file!r} is not a .py file of the {spec.target} package",
            f"give its path from the package's parent, e.g. {spec.target}/jit/comm.py "
            "(identifiers joined by /, ending in .py)",
        )
    if spec.keyword is not None and not NAME_RE.match(spec.keyword):
        raise UsageError(
            f"--keyword {spec.keyword!r} is not a keyword argument's name",
            "give the name of the list keyword, e.g. supported_major_versions",
        )
    if spec.profile and not PROFILE_RE.match(spec.profile):
        raise UsageError(
            f"--profile {spec.profile!r} is not a profile name",
            "lower-case letters, digits, - and _, e.g. my-moe",
        )
    try:
        SpecifierSet(spec.pins)
    except InvalidSpecifier:
        raise UsageError(
            f"pins '{spec.pins}' are not a PEP 440 specifier", "for example: '>=0.6.1,<0.6.16'"
        ) from None
    given = [spec.keyword is not None, bool(spec.expect), spec.add is not None]
    if any(given) and not all(given):
        raise UsageError(
            "--keyword, --expect and --add go together",
            "give all three (e.g. --keyword supported_major_versions --expect 10 --add 12) "
            "or none for a skeleton to fill in",
        )


def write(
    spec: NewPatch, directory: Path, put: Callable[[Path, str], None], *, force: bool = False
) -> Written:
    """Write the module, its test and the profile through `put` (the caller's writer: the
    files module's, `targets.files.write_output`, since the kit writes nothing itself);
    refuses to overwrite without `force`."""
    check(spec)
    directory.mkdir(parents=True, exist_ok=True)
    module = directory / f"{spec.module_name}.py"
    test = directory / f"test_{spec.module_name}.py"
    profiles = directory / "profiles.toml"
    for path in (module, test):
        if path.exists() and not force:
            raise UsageError(f"{path} exists", "pick another id, or --force to overwrite it")
    # A file of the directory the user names: no link followed, no FIFO waited on.
    existing = read_named(profiles, "profiles file").decode("utf-8") if profiles.is_file() else ""
    if f"[profiles.{_toml_key(spec.profile_name)}]" in existing and not force:
        raise UsageError(
            f"{profiles} already defines profile {spec.profile_name}",
            "pick another --profile, or add the patch to that profile by hand",
        )
    put(module, _module_text(spec))
    put(test, _test_text(spec))
    text = existing or "# Profiles of this patch pack (sm120patch's format).\nschema = 1\n"
    put(profiles, text.rstrip("\n") + "\n\n" + _profile_text(spec))
    registry = directory / "registry.toml"
    if not registry.is_file():
        return Written(module, test, profiles, spec.profile_name)
    # A pack that registers its patches (the library does) loads only the modules it lists.
    rows = read_named(registry, "registry file").decode("utf-8")
    if _registry_row(spec).splitlines()[0] not in rows.splitlines():  # --force, written before
        put(registry, rows.rstrip("\n") + "\n\n" + _registry_row(spec))
    return Written(module, test, profiles, spec.profile_name, registry)


def _toml_key(name: str) -> str:
    return name if re.match(r"^[A-Za-z0-9_-]+$", name) else f'"{name}"'


def _profile_text(spec: NewPatch) -> str:
    key = _toml_key(spec.profile_name)
    q = json.dumps  # a TOML basic string is a JSON string for the text we write
    return (
        f"[profiles.{key}]\n"
        f"title = {q(f'{spec.patch_id} (written by sm120patch new-patch)')}\n"
        'status = "experimental"\n'
        f"patches = [{q(spec.patch_id)}]\n"
        'known = "Experimental: say here what was measured, and where."\n'
        "\n"
        f"[profiles.{key}.pins]\n"
        f"{spec.target} = {q(spec.pins)}\n"
    )


def _registry_row(spec: NewPatch) -> str:
    q = json.dumps
    return (
        f"[patches.{q(spec.patch_id)}]\n"
        f"module = {q(spec.module_name)}\n"
        f"target = {q(spec.target)}\n"
        f"title = {q(TITLE)}\n"
        f"files = [{q(spec.file)}]\n"
    )


def _inner(text: str) -> str:
    """`text` escaped for the inside of a double-quoted Python string in a template (a JSON
    string's escapes are Python's: a quote, a backslash, a newline cannot end the literal)."""
    return json.dumps(text)[1:-1]


def template(name: str) -> string.Template:
    """One of the templates shipped beside this module (`templates/`, package data)."""
    from importlib import resources

    path = resources.files("sm120patch.patchkit").joinpath("templates").joinpath(name)
    return string.Template(path.read_text(encoding="utf-8"))


def _module_text(spec: NewPatch) -> str:
    if spec.complete:
        expect = list(spec.expect)
        constants = f"KEYWORD = {spec.keyword!r}\nEXPECT = {expect!r}\nADD = {spec.add!r}"
        shape = f"`{spec.keyword}={expect}` in `def {spec.function}`"
        why = f"{spec.function} passes {spec.keyword}={expect}; SM120 needs {spec.add} too."
        transform = template("transform-keyword.py.tmpl")
        check = template("check-keyword.py.tmpl")
    else:
        constants = ""
        shape = f"`def {spec.function}` (describe the code the patch changes)"
        why = "TODO: why this patch exists: what upstream does on SM120, and what it fixes."
        transform = template("transform-todo.py.tmpl")
        check = template("check-todo.py.tmpl")
    e = _inner
    return template("patch.py.tmpl").substitute(
        patch_id=e(spec.patch_id), target=e(spec.target), file=e(spec.file),
        function=e(spec.function), pins=e(spec.pins), constants=constants, shape=e(shape),
        why=e(why), title=e(TITLE),
        transform=transform.template.rstrip("\n") + "\n", reader_name=spec.module_name,
        check=check.template.rstrip("\n") + "\n",
    )


def _test_text(spec: NewPatch) -> str:
    """The test template, with the site as released, patched and in a shape to refuse: a call
    passing the keyword's list (another list for the refusal) or, for a skeleton, an empty
    function (which its transform refuses until written)."""
    if spec.complete:
        assert spec.add is not None  # complete
        before, after = list(spec.expect), [*spec.expect, spec.add]
        other = [*before[:-1], before[-1] + 1]

        def site(values: list[int]) -> str:
            return f"def {spec.function}():\n    return build({spec.keyword}={values})\n"

        cases: tuple[str, str | None, str] = (site(before), site(after), site(other))
    else:
        empty = f"def {spec.function}():\n    pass\n"
        cases = (empty, None, empty)
    return template("test_patch.py.tmpl").substitute(
        patch_id=spec.patch_id, module_name=spec.module_name,
        before=_literal(cases[0]), after=_literal(cases[1]), other=_literal(cases[2]),
    )


def _literal(text: str | None) -> str:
    """`text` as Python source, one line of it per line of the literal (None as None)."""
    if text is None:
        return "None"
    lines = "".join(f"\n    {line!r}" for line in text.splitlines(keepends=True))
    return f"({lines}\n)"
