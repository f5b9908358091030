"""Apply, revert, recover, status: the engine's contract (DESIGN.md s3). Never prints, never exits.

An apply is one transaction over every target of the profile:
    plan -> preconditions -> journal (+ pristine copies) -> write (+ one commit per patch on a
    git target) -> verify -> manifest -> close journal.
Any failure before the journal is closed rolls every target back to its pristine bytes; a kill
leaves the journal behind, and `recover` finishes the rollback. A revert is rolled forward by
`recover` instead: both end states are exact, byte for byte.

Across targets, the journals of one run share a transaction id (`txn`) and name each other
(`peers`). An apply is committed once every target's manifest of that txn is written:
`recover` then closes the journals left open instead of rolling back, so a kill between two
journal closes cannot leave one target patched and the other pristine. A revert writes every
target's journal before it changes anything, and `recover` rolls the whole of it forward,
journaling peers the killed run had not reached yet.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm120patch import __version__, catalog, interrupts, procscan, state, vcs
from sm120patch import plan as planner
from sm120patch.errors import Refused, Sm120Error
from sm120patch.plan import Plan, PlanRefused
from sm120patch.state import TargetState, file_sha256, sha256
from sm120patch.targets import Target
from sm120patch.transform import Outcome

BRANCH_PREFIX = state.BRANCH_PREFIX
# Test hooks for the kill-anywhere tests: the step at which the process kills itself (`step`,
# or `step:N` for its N-th passage), and a file to which every step passed is appended as
# `step:N` (so that the tests learn every boundary of a run).
KILL_ENV = "SM120PATCH_KILL_AT"
TRACE_ENV = "SM120PATCH_TRACE_STEPS"
_passed: dict[str, int] = {}


@dataclass
class TargetReport:
    target: Target
    branch: str | None = None
    commits: list[str] = field(default_factory=list)
    files: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.target.to_dict(),
            "branch": self.branch,
            "commits": self.commits,
            "files": self.files,
        }


@dataclass
class Report:
    action: str  # "applied", "nothing-to-do", "reverted", "recovered"
    profile: str | None
    targets: list[TargetReport]
    outcomes: list[Outcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "profile": self.profile,
            "targets": [t.to_dict() for t in self.targets],
            "outcomes": [o.to_dict() for o in self.outcomes],
            "notes": self.notes,
        }


def _kill_point(step: str) -> None:
    count = _passed[step] = _passed.get(step, 0) + 1
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a", encoding="utf-8") as fh:
            fh.write(f"{step}:{count}\n")
    if os.environ.get(KILL_ENV) in (step, f"{step}:{count}"):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    interrupts.at_step(step, count)  # [signals] a deferred SIGINT stops an apply here


class _Ctx:
    """One target during a run: its state and, for a git target, its repository."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.state = TargetState.of(target.root, target.layout, target.kind)
        self.repo = vcs.Repo(target.root) if target.layout == "git" else None

    def path(self, rel: str) -> Path:
        return state.inside(self.target.root, rel)

    def peer(self) -> dict[str, str]:
        """How a journal names this target to the other targets of its transaction."""
        t = self.target
        return {"kind": t.kind, "root": str(t.root), "layout": t.layout}


@contextmanager
def _locked(ctxs: list[_Ctx]) -> Iterator[None]:
    with ExitStack() as stack:
        for ctx in ctxs:
            stack.enter_context(ctx.state.locked())
        yield


def _refuse_unfinished(ctxs: list[_Ctx]) -> None:
    for ctx in ctxs:
        journal = ctx.state.journal()
        if journal is not None:
            raise Refused(
                f"an interrupted sm120patch {journal.get('op', 'run')} left a journal on "
                f"{ctx.target.root}",
                "run `sm120patch recover` (with the same --sglang/--flashinfer) first",
            )


def _contexts(found: list[Target]) -> list[_Ctx]:
    return [_Ctx(t) for t in found]


# ---- apply -------------------------------------------------------------------------------


def apply(
    profile_name: str,
    paths: Mapping[str, str | Path | None],
    *,
    force: bool = False,
    preconditions: Callable[[], None] | None = None,
    check_plan: Callable[[Plan], None] | None = None,
) -> Report:
    """Apply a profile to its targets as one transaction. Raises Refused with nothing changed.

    `check_plan` sees the plan before anything is written (a lock file's comparison).
    """
    cat = catalog.load()
    profile = cat.profile(profile_name)
    found = planner.resolve_targets(profile, paths)
    outside = planner.check_pins(profile, found)
    if outside and not force:
        raise Refused("; ".join(outside), "use a pinned release, or --force to apply anyway")
    git_roots = [t.root for t in found if t.layout == "git"]
    if len(git_roots) != len(set(git_roots)):
        # One branch per target is the contract; two targets in one work tree would need one
        # branch for both, which revert could not undo one target at a time.
        raise Refused(
            f"SGLang and FlashInfer are in the same git repository ({git_roots[0]}); "
            "sm120patch makes one branch per repository and target",
            "apply to separate checkouts, or to installed packages",
        )
    ctxs = _contexts(found)
    with _locked(ctxs):
        _refuse_unfinished(ctxs)
        for ctx in ctxs:
            manifest = ctx.state.manifest()
            if manifest is not None:
                other = manifest.get("profile")
                if other == profile.name:
                    return Report(
                        "nothing-to-do",
                        profile.name,
                        [TargetReport(c.target) for c in ctxs],
                        notes=[f"profile {other} is already applied on {ctx.target.root}"],
                    )
                raise Refused(
                    f"profile {other} is applied on {ctx.target.root}",
                    f"revert it first (`sm120patch revert {other}`), or apply `all`",
                )
        for ctx in ctxs:
            if ctx.repo is not None:
                # Before planning: a user's uncommitted edit must be named as such, not
                # reported as an unknown shape.
                ctx.repo.check_ready(_candidate_files(cat, profile, ctx.target))
        plan = planner.plan(profile.name, found=found, force=True)
        if plan.refused:
            raise PlanRefused(plan)
        if check_plan is not None:
            check_plan(plan)
        if not plan.applies:
            return Report(
                "nothing-to-do",
                profile.name,
                [TargetReport(c.target) for c in ctxs],
                outcomes=plan.outcomes,
                notes=["every site is already SM120-ready; nothing was changed"],
            )
        if preconditions is not None:
            preconditions()
        tplans = {tp.target.kind: tp for tp in plan.targets}
        work = [(ctx, tplans[ctx.target.kind]) for ctx in ctxs if tplans[ctx.target.kind].changed]
        branch = BRANCH_PREFIX + profile.name
        for ctx, tp in work:
            for f in tp.changed:
                _check_writable(ctx.path(tp.target.rel(f.file)))
            if ctx.repo is not None:
                if ctx.repo.branch_exists(branch):
                    raise Refused(
                        f"{ctx.target.root}: branch {branch} already exists",
                        f"delete it (`git branch -D {branch}`) or revert what is applied",
                    )
        journals: dict[str, dict[str, Any]] = {}
        reports: list[TargetReport] = []
        txn = uuid.uuid4().hex
        peers = [ctx.peer() for ctx, _ in work]
        # [signals] SIGINT/SIGTERM/SIGHUP are deferred from here to the last journal's close.
        with interrupts.critical(
            "apply",
            profile.name,
            abortable=True,
            unfinished=lambda: any(c.state.journal() is not None for c, _ in work),
        ) as guard:
            try:
                for ctx, tp in work:
                    journals[ctx.target.kind] = _start_apply(
                        ctx, tp, profile.name, branch, txn, peers
                    )
                for ctx, tp in work:
                    reports.append(_write_target(ctx, tp, profile.name, branch, plan))
                for ctx, tp in work:
                    _verify(ctx, tp)
                for (ctx, _), report in zip(work, reports, strict=True):
                    _kill_point("before-manifest")
                    _write_manifest(ctx, journals[ctx.target.kind], report)
                    _kill_point("after-manifest")
            except BaseException as exc:
                guard.rolling_back()  # [signals] nothing aborts the rollback
                _roll_back_all([ctx for ctx, _ in work], exc)
                if isinstance(exc, OSError):
                    raise Refused(
                        f"apply failed writing {exc.filename or 'a file'}: {exc.strerror}; "
                        "every file was put back as it was",
                        "fix the cause (disk space, permissions), then apply again",
                    ) from exc
                raise
            # Every manifest is written: the apply is committed (see the module's docstring).
            guard.commit()  # [signals] from here a signal no longer rolls back
            for ctx, _ in work:
                ctx.state.close_journal()
                _kill_point("after-close")
        return Report("applied", profile.name, reports, outcomes=plan.outcomes)


def _check_writable(path: Path) -> None:
    """Before the journal: every file we will write can be written, as a regular file."""
    if path.is_symlink():
        raise Refused(
            f"{path} is a symbolic link; sm120patch writes regular files only",
            "replace the link by the file it points to, or patch the tree it points into",
        )
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise Refused(
            f"cannot write in {path.parent} (permission denied); nothing was changed",
            "run sm120patch as a user who can write there, or make it writable",
        )


def _roll_back_all(ctxs: list[_Ctx], cause: BaseException) -> None:
    """Undo every target that has a journal of this run; if that fails too, say so."""
    for ctx in reversed(ctxs):
        try:
            journal = ctx.state.journal()
            if journal is not None:
                _rollback_apply(ctx, journal)
        except Exception as exc:
            raise Refused(
                f"apply failed ({cause}) and rolling back {ctx.target.root} failed too ({exc})",
                "the journal is kept: fix the cause, then run `sm120patch recover`",
            ) from exc


def _candidate_files(cat: catalog.Catalog, profile: catalog.Profile, target: Target) -> list[str]:
    """Every existing file the profile's patches may touch on this target."""
    rels = {
        target.rel(f)
        for p in cat.patches_of(profile)
        if p.target == target.kind
        for f in p.files
        if target.path_of(f).exists()
    }
    return sorted(rels)


def _start_apply(
    ctx: _Ctx,
    tp: planner.TargetPlan,
    profile: str,
    branch: str,
    txn: str,
    peers: list[dict[str, str]],
) -> dict[str, Any]:
    files = []
    for f in tp.changed:
        rel = tp.target.rel(f.file)
        path = ctx.path(rel)
        data = path.read_bytes()
        files.append(
            {
                "path": rel,
                "module": f.file,
                "before": sha256(data),
                "after": sha256(f.after.encode("utf-8")),
                "mode": path.stat().st_mode & 0o7777,
            }
        )
    git: dict[str, Any] | None = None
    if ctx.repo is not None:
        orig_branch, head = ctx.repo.head()
        git = {"branch": orig_branch, "head": head, "patch_branch": branch}
    journal = {
        "op": "apply",
        "profile": profile,
        "started": time.time(),
        **procscan.identity(),  # [signals] pid, pid_start, boot_id: recover's proof it is dead
        "tool_version": __version__,
        "target": tp.target.to_dict(),
        "files": files,
        "git": git,
        "txn": txn,
        "peers": peers,
    }
    # The journal comes first: a kill while copying then finds the files still pristine.
    ctx.state.write_journal(journal)
    for f in files:
        ctx.state.keep_copy("pristine", f["path"], ctx.path(f["path"]).read_bytes())
        _kill_point("after-copy")
    _kill_point("after-journal")
    return journal


def _write_target(
    ctx: _Ctx, tp: planner.TargetPlan, profile: str, branch: str, plan: Plan
) -> TargetReport:
    cat = catalog.load()
    order = {pid: i for i, pid in enumerate(plan.profile.patches)}
    steps = sorted(
        ((pid, f, text) for f in tp.changed for pid, text in f.step_texts()),
        key=lambda s: order[s[0]],
    )
    report = TargetReport(tp.target)
    if ctx.repo is not None:
        ctx.repo.create_branch_here(branch)
        report.branch = branch
        _kill_point("after-branch")
    for pid, f, text in steps:
        rel = tp.target.rel(f.file)
        path = ctx.path(rel)
        state.atomic_write(path, text.encode("utf-8"), mode=path.stat().st_mode)
        _drop_pycache(path)
        _kill_point("after-write")
        if ctx.repo is not None:
            patch = cat.patches[pid]
            message = (
                f"sm120patch: {patch.title}\n\n{patch.why}\n\n"
                f"Sm120patch-Patch: {pid}\n"
                f"Sm120patch-Profile: {profile}\n"
                f"Sm120patch-Version: {__version__}\n"
            )
            report.commits.append(ctx.repo.commit([rel], message))
            _kill_point("after-commit")
    for f in tp.changed:
        rel = tp.target.rel(f.file)
        ctx.state.keep_copy("patched", rel, f.after.encode("utf-8"))
        report.files.append({"path": rel, "state": "patched"})
    return report


def _verify(ctx: _Ctx, tp: planner.TargetPlan) -> None:
    """The bytes on disk are exactly the planned text. The plan already compiled that text and
    ran every patch on it again (each said already-applied): those checks hold for the file."""
    for f in tp.changed:
        path = ctx.path(tp.target.rel(f.file))
        if path.read_bytes() != f.after.encode("utf-8"):
            raise Refused(
                f"verify: {path} does not hold the planned text after writing",
                "something else is writing this file; everything was rolled back",
            )


def _write_manifest(ctx: _Ctx, journal: dict[str, Any], report: TargetReport) -> None:
    git = journal["git"]
    manifest = {
        "profile": journal["profile"],
        "patches": sorted({*catalog.load().profile(journal["profile"]).patches}),
        "tool_version": __version__,
        "applied_at": time.time(),
        "target": journal["target"],
        "files": journal["files"],
        "git": None if git is None else {**git, "commits": report.commits},
        "txn": journal["txn"],
    }
    ctx.state.write_manifest(manifest)


def _rollback_apply(ctx: _Ctx, journal: dict[str, Any]) -> None:
    """Put every file of an unfinished apply back to its pristine bytes, and git where it was."""
    files = journal.get("files", [])
    git = journal.get("git")
    _remove_temps(ctx, files)
    if ctx.repo is not None and git:
        current, _ = ctx.repo.head()
        if current == git["patch_branch"]:
            _switch_back(ctx, files, git)
        ctx.repo.delete_branch(git["patch_branch"])
    _restore_pristine(ctx, files)
    manifest = ctx.state.manifest() if (ctx.state.dir / state.MANIFEST).exists() else None
    if manifest is not None and _same_run(manifest, journal):
        ctx.state.remove_manifest()
    ctx.state.drop_copies()
    ctx.state.close_journal()


def _same_run(manifest: dict[str, Any], journal: dict[str, Any]) -> bool:
    """Whether `manifest` was written by the apply of `journal` (not one applied before)."""
    if journal.get("txn"):
        return bool(manifest.get("txn") == journal["txn"])
    return bool(manifest.get("applied_at", 0) >= journal.get("started", 0))


def _switch_back(ctx: _Ctx, files: list[dict[str, Any]], git: dict[str, Any]) -> None:
    """From the patch branch back to the user's branch (or detached commit)."""
    assert ctx.repo is not None
    # Reset our files to the branch so the switch is clean (a revert with edits there got
    # --force); other dirty files ride along untouched.
    # Paths from state: inside the target (checked again here), and taken literally by git.
    ctx.repo.discard([f["path"] for f in files if ctx.path(f["path"])])
    _kill_point("during-switch")
    ctx.repo.switch(git["branch"], git["head"])
    _kill_point("after-switch")


def _remove_temps(ctx: _Ctx, files: list[dict[str, Any]]) -> None:
    """A run killed inside a write leaves a temp file next to the file: not the user's."""
    for f in files:
        state.remove_temps(ctx.path(f["path"]))
    ctx.state.remove_temps()


def _restore_pristine(ctx: _Ctx, files: list[dict[str, Any]]) -> None:
    for f in files:
        path = ctx.path(f["path"])
        if file_sha256(path) == f["before"]:
            continue
        data = ctx.state.copy("pristine", f["path"])
        if data is None or sha256(data) != f["before"]:
            raise Refused(
                f"the pristine copy of {path} is missing or damaged",
                f"restore the file by hand (state in {ctx.state.dir})",
            )
        state.atomic_write(path, data, mode=f.get("mode"))
        _drop_pycache(path)
        _kill_point("after-write")


def _drop_pycache(path: Path) -> None:
    """Stale bytecode of a module we rewrote must not outlive it."""
    cache = path.parent / "__pycache__"
    if cache.is_dir() and not cache.is_symlink():
        for pyc in cache.glob(f"{path.stem}.*.pyc"):
            try:
                pyc.unlink()
            except FileNotFoundError:
                pass


# ---- revert ------------------------------------------------------------------------------


def revert(
    profile_name: str | None,
    paths: Mapping[str, str | Path | None],
    *,
    force: bool = False,
    keep_branch: bool = False,
) -> Report:
    """Revert `profile_name` (None: whatever is applied) on the targets at `paths`."""
    kinds = _kinds_for(profile_name)
    found = [
        _find_quiet(kind, paths.get(kind), required=paths.get(kind) is not None) for kind in kinds
    ]
    ctxs = _contexts([t for t in found if t is not None])
    reports: list[TargetReport] = []
    with _locked(ctxs):
        _refuse_unfinished(ctxs)
        todo = []
        for ctx in ctxs:
            manifest = ctx.state.manifest()
            if manifest is None:
                continue
            if profile_name is not None and manifest["profile"] != profile_name:
                raise Refused(
                    f"profile {manifest['profile']} is applied on {ctx.target.root}, "
                    f"not {profile_name}",
                    f"run `sm120patch revert {manifest['profile']}` or `revert --all`",
                )
            todo.append((ctx, manifest))
        if not todo:
            what = f"profile {profile_name}" if profile_name else "anything"
            where = ", ".join(str(c.target.root) for c in ctxs) or "any target found"
            raise Refused(
                f"sm120patch has not applied {what} on {where}", "see `sm120patch status`"
            )
        for ctx, manifest in todo:
            if ctx.repo is not None:
                ctx.repo.check_idle()
            _check_revertable(ctx, manifest, force)
        txn = uuid.uuid4().hex
        peers = [ctx.peer() for ctx, _ in todo]
        journals = []
        # [signals] deferred from the first journal write to the last close: a revert is
        # finished, never cut short.
        with interrupts.critical(
            "revert",
            profile_name,
            abortable=False,
            unfinished=lambda: any(c.state.journal() is not None for c, _ in todo),
        ):
            for ctx, manifest in todo:
                journal = {
                    "op": "revert",
                    "profile": manifest["profile"],
                    "started": time.time(),
                    **procscan.identity(),  # [signals] as in _start_apply
                    "keep_branch": keep_branch,
                    "manifest": manifest,
                    "txn": txn,
                    "peers": peers,
                }
                ctx.state.write_journal(journal)
                _kill_point("after-journal")
                journals.append((ctx, journal))
            # Every journal is written before anything changes: from here on, recover rolls
            # the whole revert forward.
            try:
                for ctx, journal in journals:
                    reports.append(_finish_revert(ctx, journal))
            except OSError as exc:
                raise Refused(
                    f"revert failed writing {exc.filename or 'a file'}: {exc.strerror}",
                    "the journal is kept: fix the cause (disk space, permissions), then run "
                    "`sm120patch recover` to finish the revert",
                ) from exc
    return Report("reverted", profile_name, reports)


def _kinds_for(profile_name: str | None) -> tuple[str, ...]:
    if profile_name is None:
        return catalog.TARGETS
    return catalog.load().profile(profile_name).targets


def _find_quiet(kind: str, path: str | Path | None, *, required: bool) -> Target | None:
    from sm120patch import targets

    try:
        return targets.find(kind, path)
    except Refused:
        if required:
            raise
        return None


def _check_revertable(ctx: _Ctx, manifest: dict[str, Any], force: bool) -> None:
    for f in manifest["files"]:
        path = ctx.path(f["path"])
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise Refused(
                f"{ctx.target.root}: the state of the apply names {f['path']}, which is not a "
                "regular file",
                f"inspect {ctx.state.dir / state.MANIFEST}; if it is damaged, move it aside",
            )
    drifted = [
        f
        for f in manifest["files"]
        if file_sha256(ctx.path(f["path"])) not in (f["after"], f["before"])
    ]
    git = manifest.get("git")
    problems = []
    if drifted:
        problems.append(_drift_diff(ctx, drifted))
    if ctx.repo is not None and git:
        branch, head = ctx.repo.head()
        commits = git.get("commits") or []
        if branch != git["patch_branch"]:
            raise Refused(
                f"{ctx.target.root} is on {branch or 'a detached HEAD'}, not {git['patch_branch']}",
                f"`git checkout {git['patch_branch']}`, then revert",
            )
        if commits and head != commits[-1]:
            problems.append(f"{git['patch_branch']} has commits after sm120patch's ({head[:12]})")
    # What the revert will restore from must be there before its journal is written: a
    # damaged state is refused with nothing changed, not found halfway through.
    for f in manifest["files"]:
        path = ctx.path(f["path"])
        if ctx.repo is not None and git:
            missing = ctx.repo.show(git["patch_branch"], f["path"]) is None
        else:
            copy = ctx.state.copy("pristine", f["path"])
            missing = file_sha256(path) != f["before"] and (
                copy is None or sha256(copy) != f["before"]
            )
        if missing:
            raise Refused(
                f"{ctx.target.root}: the state of the apply does not match the tree: "
                f"{f['path']} cannot be restored from it",
                f"restore the file by hand, then move {ctx.state.dir} aside",
            )
    if problems and not force:
        raise Refused(
            f"{ctx.target.root}: changed since the apply; refusing to throw that away:\n"
            + "\n".join(problems),
            "keep your edits elsewhere, or `revert --force` to discard them",
        )


def _drift_diff(ctx: _Ctx, drifted: list[dict[str, Any]]) -> str:
    import difflib

    out = []
    for f in drifted:
        ours = (ctx.state.copy("patched", f["path"]) or b"").decode("utf-8", "replace")
        try:
            now = ctx.path(f["path"]).read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            now = ""
        out.extend(
            difflib.unified_diff(
                ours.splitlines(True),
                now.splitlines(True),
                f"sm120patch/{f['path']}",
                f"yours/{f['path']}",
            )
        )
    return "".join(out).rstrip("\n")


def _finish_revert(ctx: _Ctx, journal: dict[str, Any]) -> TargetReport:
    """Idempotent: run again from the journal, it converges on the pristine tree."""
    manifest = journal["manifest"]
    files = manifest["files"]
    git = manifest.get("git")
    report = TargetReport(ctx.target)
    _remove_temps(ctx, files)
    if ctx.repo is not None and git:
        current, _ = ctx.repo.head()
        if current == git["patch_branch"]:
            _switch_back(ctx, files, git)
        if journal.get("keep_branch"):
            report.branch = git["patch_branch"]
        else:
            ctx.repo.delete_branch(git["patch_branch"])
    _restore_pristine(ctx, files)
    for f in files:
        report.files.append({"path": f["path"], "state": "pristine"})
    _kill_point("before-manifest")
    ctx.state.remove_manifest()
    _kill_point("after-manifest")
    ctx.state.drop_copies()
    ctx.state.close_journal()
    _kill_point("after-close")
    return report


# ---- recover -----------------------------------------------------------------------------


def recover(paths: Mapping[str, str | Path | None]) -> Report:
    """Finish what a killed run left: roll an apply back, roll a revert forward."""
    found = [
        _find_quiet(kind, paths.get(kind), required=paths.get(kind) is not None)
        for kind in catalog.TARGETS
    ]
    ctxs = _with_peers(_contexts([t for t in found if t is not None]))
    reports = []
    notes = []
    with _locked(ctxs), interrupts.critical(  # [signals] recover is finished, never cut short
        "recover",
        None,
        abortable=False,
        unfinished=lambda: any(c.state.journal() is not None for c in ctxs),
    ):
        journals = {ctx.target.kind: ctx.state.journal() for ctx in ctxs}
        for ctx in ctxs:
            journal = journals[ctx.target.kind]
            if ctx.repo is not None and journal is not None:
                # [signals] a git killed with the run may have left index.lock: removed once
                # the run and every git process in the repository are provably gone.
                for lock in ctx.repo.settle_after_kill(journal):
                    notes.append(f"{ctx.target.root}: removed {lock}, left by a killed git")
                ctx.repo.check_idle()
        _journal_revert_peers(ctxs, journals)
        for ctx in ctxs:
            journal = journals[ctx.target.kind]
            if journal is None:
                continue
            profile = journal.get("profile")
            if journal["op"] == "apply" and _apply_committed(journal):
                _remove_temps(ctx, journal["files"])
                ctx.state.close_journal()
                notes.append(
                    f"{ctx.target.root}: the interrupted apply of {profile} had written "
                    "every target; kept it"
                )
            elif journal["op"] == "apply":
                _rollback_apply(ctx, journal)
                notes.append(f"{ctx.target.root}: rolled back the interrupted apply of {profile}")
            else:
                _finish_revert(ctx, journal)
                notes.append(f"{ctx.target.root}: finished the interrupted revert of {profile}")
            reports.append(TargetReport(ctx.target))
    if not reports:
        notes.append("nothing to recover")
    return Report("recovered", None, reports, notes=notes)


def _peer_state(peer: dict[str, str]) -> TargetState:
    root = Path(peer["root"])
    return TargetState.of(root, peer["layout"], peer["kind"])


def _with_peers(ctxs: list[_Ctx]) -> list[_Ctx]:
    """`ctxs` and the targets their journals name: recover finishes a whole transaction."""
    out = list(ctxs)
    # (kind, root): SGLang and FlashInfer may share a root (one site-packages).
    seen = {(ctx.target.kind, ctx.target.root) for ctx in ctxs}
    for ctx in ctxs:
        journal = ctx.state.journal()
        for peer in journal.get("peers", []) if journal else []:
            root = Path(peer["root"])
            if (peer["kind"], root) in seen or peer["kind"] in {c.target.kind for c in out}:
                continue
            try:
                target = _find_quiet(peer["kind"], root, required=False)
            except Sm120Error:
                target = None  # gone: its own journal (if any) is recovered where it is
            if target is not None and target.root == root:
                out.append(_Ctx(target))
                seen.add((peer["kind"], root))
    return out


def _apply_committed(journal: dict[str, Any]) -> bool:
    """Whether every target of the journal's apply has its manifest of that apply."""
    txn = journal.get("txn")
    if not txn:
        return False
    for peer in journal.get("peers", []):
        manifest = _peer_state(peer).manifest()
        if manifest is None or manifest.get("txn") != txn:
            return False
    return True


def _journal_revert_peers(ctxs: list[_Ctx], journals: dict[str, dict[str, Any] | None]) -> None:
    """A revert killed while writing its journals: journal the targets it had not reached.

    Such a target still holds the manifest the revert was started on (nothing changes before
    every journal is written), and the user asked for its revert.
    """
    for journal in [j for j in journals.values() if j and j["op"] == "revert"]:
        named = {(p["kind"], Path(p["root"])) for p in journal.get("peers", [])}
        for ctx in ctxs:
            kind = ctx.target.kind
            if (kind, ctx.target.root) not in named or journals[kind] is not None:
                continue
            manifest = ctx.state.manifest()
            if manifest is None or not manifest.get("txn"):
                continue  # finished, or nothing of ours to revert
            own = {**journal, "manifest": manifest, "profile": manifest["profile"]}
            ctx.state.write_journal(own)
            journals[kind] = own


# ---- status ------------------------------------------------------------------------------


@dataclass
class TargetStatus:
    target: Target
    profile: str | None
    branch: str | None
    base: str | None
    files: list[dict[str, str]]
    unfinished: str | None
    trials: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.target.to_dict(),
            "profile": self.profile,
            "branch": self.branch,
            "base": self.base,
            "files": self.files,
            "unfinished": self.unfinished,
            "trials": self.trials,
        }


def status(paths: Mapping[str, str | Path | None]) -> list[TargetStatus]:
    """What is applied where, from hashes only (no parsing, no git process)."""
    out = []
    for kind in catalog.TARGETS:
        target = _find_quiet(kind, paths.get(kind), required=paths.get(kind) is not None)
        if target is None:
            continue
        st = TargetState.of(target.root, target.layout, target.kind)
        journal = st.journal()
        manifest = st.manifest()
        files = []
        branch = base = profile = None
        trials: list[dict[str, Any]] = []
        if manifest is not None:
            profile = manifest["profile"]
            git = manifest.get("git")
            if git:
                branch, base = git["patch_branch"], git["head"]
            for f in manifest["files"]:
                now = file_sha256(state.inside(target.root, f["path"]))
                word = (
                    "patched"
                    if now == f["after"]
                    else "pristine"
                    if now == f["before"]
                    else "drifted"
                )
                files.append({"path": f["path"], "state": word})
        trials = st.trials()
        out.append(
            TargetStatus(
                target, profile, branch, base, files, journal.get("op") if journal else None, trials
            )
        )
    return out


def record_trial(
    paths: Mapping[str, str | Path | None], profile: str, trial: dict[str, Any]
) -> None:
    """Keep a trial's record on every target of its profile (it survives the revert)."""
    for kind in catalog.load().profile(profile).targets:
        target = _find_quiet(kind, paths.get(kind), required=False)
        if target is None:
            continue
        ctx = TargetState.of(target.root, target.layout, target.kind)
        with ctx.locked():
            ctx.add_trial(trial)
