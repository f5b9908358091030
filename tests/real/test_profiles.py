"""Profiles on real releases: no refusal inside the pins, names the patches use are defined, and
the dry-run diff of `all` applies with `git apply` to a git repository of the release."""

from __future__ import annotations

import ast
import itertools
import shutil
import subprocess
from pathlib import Path

import pytest
from expected import fact
from realcache import RealReleases, SiteCase, chain_of, release_set

from sm120patch.errors import Refused
from sm120patch.patchkit import sitecheck
from sm120patch.patchkit.model import Status
from sm120patch.plan import catalog
from sm120patch.plan.diffs import unified_diff
from sm120patch.plan.planner import plan
from sm120patch.plan.plans import Plan

pytestmark = pytest.mark.real

PROFILES = tuple(catalog.load().profiles)  # every profile, pcie-allreduce included
# The combinations whose `apply all --dry-run` diff must pass `git apply --check`.
GIT_APPLY = (("0.5.8", "0.6.1"), ("0.5.22", "0.6.1"))


def pinned(profile: str, kind: str) -> list[str]:
    prof = catalog.load().profile(profile)
    if kind not in prof.pins:  # a profile on vLLM alone pins no SGLang
        return []
    return [v for v in release_set(kind) if prof.pinned(kind, v)]


def composed_cases() -> list[tuple[str, str, str]]:
    """(profile, kind, version) for every release of the session inside the profile's pins."""
    cat = catalog.load()
    return [
        (name, kind, v)
        for name in PROFILES
        for kind in cat.profile(name).targets
        for v in pinned(name, kind)
    ]


def planned_cases() -> list[tuple[str, str, str | None]]:
    """(profile, SGLang, FlashInfer) combinations to plan for real: the oldest and newest
    pinned SGLang of the session per profile, each with a pinned FlashInfer (taken in turn),
    plus the git-apply combinations for `all`."""
    out: list[tuple[str, str, str | None]] = []
    for name in PROFILES:
        sg = pinned(name, "sglang")
        has_fi = "flashinfer" in catalog.load().profile(name).pins
        if has_fi and not pinned(name, "flashinfer"):
            # No FlashInfer of the session inside its pins (pcie-ipc: 0.7.0 on), and a command
            # naming its SGLang uses no other FlashInfer: test_cycle_newest plans it on 0.7.4.
            continue
        fi = itertools.cycle(pinned(name, "flashinfer")) if has_fi else None
        for v in dict.fromkeys([sg[0], sg[-1]] if sg else []):
            out.append((name, v, next(fi) if fi else None))
    for sg_v, fi_v in GIT_APPLY:
        if ("all", sg_v, fi_v) not in out:
            out.append(("all", sg_v, fi_v))
    return out


@pytest.mark.parametrize(("profile", "kind", "version"), composed_cases(),
                         ids=lambda x: str(x))
def test_profile_on_pinned_release(
    real: RealReleases, profile: str, kind: str, version: str
) -> None:
    """Every patch of the profile on this release: the outcome its site run gave, judged as the
    profile judges it (a missing site only where the profile says so); none refused; and the
    SM120 names the patched files use are defined in them."""
    prof = catalog.load().profile(profile)
    cat = catalog.load()
    if prof.status == "refused":  # vllm-fp8-moe: every site is found and refused, nothing written
        for pid in prof.patches:
            run = real.site(SiteCase(pid, kind, version))
            assert run.outcome.status is Status.REFUSED, run.outcome.describe()
            assert run.after == run.before
        return
    refusals = []
    finals: dict[str, str] = {}
    for pid in prof.patches:
        if cat.patches[pid].target != kind:
            continue
        run = real.site(SiteCase(pid, kind, version))
        status = run.outcome.status
        if status is Status.NOT_APPLICABLE and not prof.absent_ok(pid, version):
            refusals.append(f"{pid}: not-applicable, but {profile} expects it in {version}")
        elif status is Status.REFUSED:
            refusals.append(run.outcome.describe())
        if run.file and run.after != run.before:
            finals[run.file] = run.after  # chain order: the last step holds every change
    assert not refusals, "\n".join(refusals)
    assert_sm120_names_defined(real, kind, version, finals)


def _used_unbound(tree: ast.Module) -> set[str]:
    """The SM120 names read where nothing binds them: neither module level nor an import inside
    the function that reads them (a helper a patch adds imports SGLang's check where it runs)."""
    bound = sitecheck.module_bindings(tree)
    covered: set[int] = set()  # the reads inside a function that imports the name itself
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local = {(a.asname or a.name).split(".")[0] for n in ast.walk(fn)
                     if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
            covered |= {id(n) for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in local}
    return {
        n.id for n in ast.walk(tree)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound
        and sitecheck.arch_of(n) == 120 and id(n) not in covered
    }


def assert_sm120_names_defined(
    real: RealReleases, kind: str, version: str, texts: dict[str, str]
) -> None:
    """No NameError at import: every SM120 name a patched file reads is bound in it, and one
    imported from sglang.srt.utils exists there in this release."""
    for file, text in texts.items():
        tree = ast.parse(text)
        unbound = _used_unbound(tree)
        assert not unbound, f"{file} uses {sorted(unbound)} without defining them"
        for name, (module, _) in sitecheck.imported(tree).items():
            if sitecheck.arch_of(ast.Name(name)) == 120 and module.startswith("sglang.srt.utils"):
                root = real.tree(kind, version)
                sources = [root / "sglang/srt/utils.py", root / "sglang/srt/utils/common.py"]
                assert any(
                    p.is_file() and sitecheck.defines(p.read_text(encoding="utf-8"), name)
                    for p in sources
                ), f"{file} imports {name} from {module}; SGLang {version} does not define it"


def _git(repo: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-c", "user.name=sm120patch-tests", "-c", "user.email=tests@invalid",
         "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false", *args],
        cwd=repo, input=stdin, capture_output=True, text=True, check=False,
    )


def git_repo_of(tree: Path, dest: Path, version_txt: str | None = None) -> Path:
    """A git repository whose one commit is the release tree, as a user's checkout would be;
    FlashInfer's repository keeps its version in `version.txt` at its root (`version_txt`)."""
    shutil.copytree(tree, dest)
    if version_txt is not None:
        (dest / "version.txt").write_text(version_txt + "\n")
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-q", "-m", "release")):
        done = _git(dest, *args)
        assert done.returncode == 0, done.stderr
    return dest


@pytest.mark.parametrize(("profile", "sglang", "flashinfer"), planned_cases(),
                         ids=lambda x: str(x))
def test_plan_on_git_repos(
    real: RealReleases, tmp_path: Path, profile: str, sglang: str, flashinfer: str | None
) -> None:
    """The planner itself (sm120patch.plan.planner.plan) on git repositories of pinned releases: no
    refusal, the same outcome per site as the site runs, and a diff `git apply` accepts."""
    paths = {"sglang": git_repo_of(real.tree("sglang", sglang), tmp_path / "sglang")}
    if flashinfer:
        paths["flashinfer"] = git_repo_of(real.tree("flashinfer", flashinfer),
                                          tmp_path / "flashinfer", version_txt=flashinfer)
    prof = catalog.load().profile(profile)
    refused = [r for kind, v in (("sglang", sglang), ("flashinfer", flashinfer)) if v
               for r in prof.refusals(kind, v)]
    if refused:  # a release the profile refuses: only with --force, saying why
        with pytest.raises(Refused, match="refuses"):
            plan(profile, paths)
    result: Plan = plan(profile, paths, force=bool(refused))
    assert len(result.outside_pins) == len(refused)  # what --force overrode, nothing else
    assert not result.refused, "\n".join(o.describe() for o in result.refused)
    for outcome in result.outcomes:
        version = sglang if outcome.target == "sglang" else flashinfer
        assert version is not None
        site = real.site(SiteCase(outcome.patch, outcome.target, version))
        assert outcome.status is site.outcome.status, outcome.describe()
        known = fact(outcome.patch, version)
        if known is not None and known.file is not None:
            assert outcome.file == known.file
    for tp in result.targets:
        assert tp.target.layout == "git"
        diff = "".join(unified_diff(tp.target, f) for f in tp.changed)
        repo = tp.target.root
        if not diff:
            continue
        check = _git(repo, "apply", "--check", "-", stdin=diff)
        assert check.returncode == 0, f"git apply --check in {repo}:\n{check.stderr}"
        applied = _git(repo, "apply", "-", stdin=diff)
        assert applied.returncode == 0, applied.stderr
        for f in tp.changed:
            assert tp.target.path_of(f.file).read_text(encoding="utf-8") == f.after
        assert_sm120_names_defined(
            real, tp.target.kind, tp.target.version, {f.file: f.after for f in tp.changed}
        )
    # The whole diff names files relative to each target root, the way `git apply` wants them.
    heads = [line for line in result.diff().splitlines() if line.startswith("diff --git")]
    assert heads and all(h.split()[2].startswith(("a/sglang/", "a/flashinfer/")) for h in heads)


def test_chains_follow_profiles() -> None:
    """The site runs use each patch's profile order (a patch relies on the earlier ones)."""
    cat = catalog.load()
    for pid, patch in cat.patches.items():
        chain = chain_of(pid)
        assert pid in chain and all(cat.patches[p].target == patch.target for p in chain)


def test_a_local_import_binds_only_the_function_that_makes_it() -> None:
    tree = ast.parse(
        "def f():\n    from sglang.srt.utils import is_sm120\n    return is_sm120()\n"
        "def g():\n    return is_sm120()\n"
    )
    assert _used_unbound(tree) == {"is_sm120"}  # g's read; f's own import binds f's
    assert _used_unbound(ast.parse("from sglang.srt.utils import is_sm120\nx = is_sm120()\n")) == set()
