"""`sm120patch new-patch ID`: write a patch module, its facts table, a profile and a test into a
patch pack directory, the way `alembic revision` writes a revision script to fill in.

With `--keyword`, `--expect` and `--add` the module is complete: one `extend_keyword_list`
operation (`f(..., supported_major_versions=[10])` -> `[10, 12]` in one named function).
Without them its transform refuses until written, and so does its test.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from sm120patch.errors import UsageError
from sm120patch.patchkit.model import TARGETS

ID_RE = re.compile(r"^[a-z][a-z0-9]*(?:[.-][a-z0-9]+)+$")


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
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", spec.function):
        raise UsageError(
            f"'{spec.function}' is not a function name",
            "--function takes the name of the function holding the site, e.g. gen_comm_module",
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
    existing = profiles.read_text(encoding="utf-8") if profiles.is_file() else ""
    if f"[profiles.{_toml_key(spec.profile_name)}]" in existing and not force:
        raise UsageError(
            f"{profiles} already defines profile {spec.profile_name}",
            "pick another --profile, or add the patch to that profile by hand",
        )
    put(module, _module_text(spec))
    put(test, _test_text(spec))
    text = existing or "# Profiles of this patch pack (sm120patch's format).\nschema = 1\n"
    put(profiles, text.rstrip("\n") + "\n\n" + _profile_text(spec))
    return Written(module, test, profiles, spec.profile_name)


def _toml_key(name: str) -> str:
    return name if re.match(r"^[A-Za-z0-9_-]+$", name) else f'"{name}"'


def _profile_text(spec: NewPatch) -> str:
    key = _toml_key(spec.profile_name)
    return (
        f"[profiles.{key}]\n"
        f'title = "{spec.patch_id} (written by sm120patch new-patch)"\n'
        'status = "experimental"\n'
        f'patches = ["{spec.patch_id}"]\n'
        'known = "Experimental: say here what was measured, and where."\n'
        "\n"
        f"[profiles.{key}.pins]\n"
        f'{spec.target} = "{spec.pins}"\n'
    )


def _module_text(spec: NewPatch) -> str:
    if spec.complete:
        expect = list(spec.expect)
        constants = (
            f'KEYWORD = "{spec.keyword}"\n'
            f"EXPECT = {expect}\n"
            f"ADD = {spec.add}\n"
        )
        shape = f"`{spec.keyword}={expect}` in `def {spec.function}`"
        body = (
            "    from sm120patch.patchkit import operations as op\n"
            "\n"
            "    return op.extend_keyword_list(\n"
            "        module, function=FUNCTION, keyword=KEYWORD, expect=EXPECT, add=ADD\n"
            "    )\n"
        )
        why = f"{spec.function} passes {spec.keyword}={expect}; SM120 needs {spec.add} too."
    else:
        constants = ""
        shape = f"`def {spec.function}` (describe the code the patch changes)"
        body = (
            "    # Write the change here with sm120patch.patchkit.operations (widen_arch_or,\n"
            "    # extend_keyword_list, add_module_flag, add_elif; the imports its code needs\n"
            "    # as `result.needing(Import(...))`) and return its Result; raise Refuse or\n"
            "    # NotApplicable where it stops early. Until then the patch refuses, so\n"
            "    # nothing is ever half-done.\n"
            "    from sm120patch.patchkit.model import Refuse\n"
            "\n"
            '    raise Refuse(FUNCTION, "a transform for this site", "none written yet")\n'
        )
        why = "TODO: why this patch exists: what upstream does on SM120, and what it fixes."
    return f'''"""{spec.patch_id}: written by `sm120patch new-patch`; fill in the TODOs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Result, Status

if TYPE_CHECKING:
    import libcst as cst

FILE = "{spec.file}"
FUNCTION = "{spec.function}"
{constants}
# What the patch does on which release: one fact per range of releases with one shape. The
# profile's pins may only cover releases a fact covers (the real-release tests fail otherwise).
FACTS = (
    Fact(
        releases="{spec.pins}",
        status=Status.APPLIED,
        shape="{shape}",
        file=FILE,
        function=FUNCTION,
        source="TODO: the releases this was read off",
    ),
)


def transform(module: cst.Module) -> Result:
{body}

PATCH = Patch(
    id="{spec.patch_id}",
    target="{spec.target}",
    title="TODO: one line saying what the patch changes",
    why="{why}",
    marker=f"def {{FUNCTION}}",
    transform=transform,
    facts=FACTS,
)
'''


def _test_text(spec: NewPatch) -> str:
    load = f'''"""Before/after test of {spec.patch_id} (written by `sm120patch new-patch`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sm120patch.patchkit.model import Status
from sm120patch.patchkit.runner import transform_text


def load_patch():
    path = Path(__file__).with_name("{spec.module_name}.py")
    spec = importlib.util.spec_from_file_location("{spec.module_name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PATCH
'''
    if not spec.complete:
        return load + f'''

BEFORE = "def {spec.function}():\\n    pass\\n"


def test_refuses_until_written():
    [outcome] = transform_text([load_patch()], "site.py", BEFORE).outcomes
    assert outcome.status is Status.REFUSED, outcome.describe()
'''
    before = list(spec.expect)
    after = [*before, spec.add]
    other = [*before[:-1], before[-1] + 1]
    return load + f'''

BEFORE = "def {spec.function}():\\n    return build({spec.keyword}={before})\\n"
AFTER = "def {spec.function}():\\n    return build({spec.keyword}={after})\\n"


def test_applies_then_is_already_applied():
    res = transform_text([load_patch()], "site.py", BEFORE)
    [outcome] = res.outcomes
    assert outcome.status is Status.APPLIED, outcome.describe()
    assert res.after == AFTER
    [again] = transform_text([load_patch()], "site.py", AFTER).outcomes
    assert again.status is Status.ALREADY_APPLIED, again.describe()


def test_refuses_another_list():
    source = BEFORE.replace("{before}", "{other}")
    [outcome] = transform_text([load_patch()], "site.py", source).outcomes
    assert outcome.status is Status.REFUSED, outcome.describe()


def test_not_applicable_without_the_function():
    [outcome] = transform_text([load_patch()], "site.py", "x = 1\\n").outcomes
    assert outcome.status is Status.NOT_APPLICABLE, outcome.describe()
'''
