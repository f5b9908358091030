"""The two layouts of a target and how each records, rolls back and reverts an apply.

- `GitLayout` (a checkout): the apply is a branch `sm120patch/<profile>` made from the user's
  HEAD with one commit per patch, built in git's object database with an index of its own; the
  branch moves once, then the work tree is checked out once (StGit's transaction: a kill before
  the branch moves leaves nothing to undo); git restores. Revert returns to the user's branch
  as it is now (their commits made since are kept) and checks each touched file equals that
  branch's content; sm120patch never writes pristine bytes over a branch.
- `InstalledLayout` (a package in site-packages): pristine copies kept in the target's state
  directory; revert writes them back only when they are the release's own bytes: the sha256
  the dist-info RECORD lists for the file (or, for a file no RECORD lists, the before-hash of
  the manifest in the owner-only state directory). A restore writes over the file that is
  there, keeping its mode (never setuid, setgid or world-writable); a deleted file is
  reported, never created again.

The engine drives both through one interface (`TargetLayout`) and never asks which it has: the
layout is the only writer of a target's files, on apply, rollback, revert and recover. Neither
prints.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from sm120patch.engine import interrupts, records
from sm120patch.engine.assess import file_verdict
from sm120patch.engine.records import FileRecord, GitBase, Journal
from sm120patch.engine.store import TargetState
from sm120patch.errors import Refused
from sm120patch.patchkit.runner import FileResult
from sm120patch.targets import Target, git
from sm120patch.targets.files import sha256
from sm120patch.targets.installed import record_hashes

# Path -> the bytes a revert leaves there (None: none to be had).
Restored = dict[str, bytes | None]
# (patch id, the file's plan, the text to write) for each write an apply makes, in order.
Step = tuple[str, FileResult, str]
# (path relative to the target's root, the text to write, the commit message): a step to write.
Write = tuple[str, str, str]


class TargetLayout(Protocol):
    """How a target records, rolls back and reverts an apply (a checkout, an installed package)."""

    # The bytes this run read before writing (rel -> bytes), and what a restore left alone.
    originals: dict[str, bytes]
    notes: list[str]

    def path(self, rel: str) -> Path: ...
    def released(self, f: FileRecord) -> str | None: ...
    def check_ready(self, rels: list[str]) -> None: ...
    def patch_branch(self, profile: str) -> str | None: ...
    def base(self, patch_branch: str | None) -> GitBase | None: ...
    def keeps_pristine(self) -> bool: ...
    def steps(self, changed: Sequence[FileResult], order: Mapping[str, int]) -> list[Step]: ...
    def write_all(self, writes: Sequence[Write], base: GitBase | None) -> list[str]: ...
    def of_this_run(self, files: tuple[FileRecord, ...]) -> tuple[FileRecord, ...]: ...
    def roll_back(self, files: tuple[FileRecord, ...], base: GitBase | None) -> None: ...
    def check_can_restore(self, files: tuple[FileRecord, ...], base: GitBase | None) -> None: ...
    def changes_since_apply(self, base: GitBase | None) -> list[str]: ...
    def finish_revert(
        self, files: tuple[FileRecord, ...], base: GitBase | None, keep_branch: bool
    ) -> str | None: ...
    def settle_after_kill(self, journal: Journal) -> list[str]: ...
    def restores(self, files: tuple[FileRecord, ...], base: GitBase | None) -> Restored: ...
    def drop_branch(self, base: GitBase | None, keep_branch: bool) -> list[str]: ...
    def restore_pristine(self, touched: tuple[FileRecord, ...]) -> None: ...
    def undo_own_writes(self) -> None: ...


class InstalledLayout:
    name = "installed"

    def __init__(self, target: Target, st: TargetState) -> None:
        self.target = target
        self.state = st
        # The tree as found, held open: every read and write of its files goes through it.
        self.tree = target.handle
        # The bytes this very run read from the target before writing (rel -> bytes): what
        # an apply that fails rolls back to, read from the tree, not from the state.
        self.originals: dict[str, bytes] = {}
        # What a restore left alone, for the report (a deleted file is not created again).
        self.notes: list[str] = []
        # The files this run replaced: all that an in-run rollback has to put back.
        self.written: set[str] = set()
        self._record: dict[str, str] | None = None

    def path(self, rel: str) -> Path:
        """`rel`'s path, for messages (files are reached through `tree`)."""
        return self.tree.shown(rel)

    def released(self, f: FileRecord) -> str | None:
        """The sha256 of the file as its release installed it (the dist-info RECORD), or None
        when no RECORD lists it."""
        if self._record is None:
            self._record = record_hashes(self.target)
        return self._record.get(f.module)

    def pristine_bytes(self, f: FileRecord) -> bytes:
        """The bytes a restore of `f` may write: the release's own. This run's own reading of
        the file; else the pristine copy, when its sha256 is the RECORD's for the file (or,
        where no RECORD lists it, the manifest's before-hash: the state directory is the
        target owner's alone, `TargetState.check_trusted`). Refuses otherwise."""
        path = self.path(f.path)
        mine = self.originals.get(f.path)
        if mine is not None and sha256(mine) == f.before:
            return mine
        copy = self.state.copy("pristine", f.path)
        if copy is None or sha256(copy) != f.before:
            raise Refused(
                f"the pristine copy of {path} is missing or damaged",
                f"restore the file by hand (state in {self.state.dir})",
            )
        release = self.released(f)
        if release is not None and sha256(copy) != release:
            t = self.target
            raise Refused(
                f"{path}: the copy kept from before the apply is not the file of {t.name} "
                f"{t.version} as installed (its RECORD lists another sha256); sm120patch "
                "writes back only the release's own bytes",
                "reinstall the release (`pip install --force-reinstall --no-deps "
                f"{t.kind}=={t.version}`), then run sm120patch again",
            )
        return copy

    # ---- apply ------------------------------------------------------------------------
    def check_ready(self, rels: list[str]) -> None:
        """Nothing to check beyond what the plan read: no version control here."""

    def patch_branch(self, profile: str) -> str | None:
        return None

    def base(self, patch_branch: str | None) -> GitBase | None:
        return None

    def keeps_pristine(self) -> bool:
        return True

    def steps(self, changed: Sequence[FileResult], order: Mapping[str, int]) -> list[Step]:
        """No commits to make: each file is written once, with its final text."""
        return [(f.step_texts()[-1][0], f, f.after) for f in changed]

    def write_all(self, writes: Sequence[Write], base: GitBase | None) -> list[str]:
        """Each file's final text, one atomic write after another (no commits: [])."""
        for rel, text, _ in writes:
            self.write(rel, text)
            interrupts.kill_point("after-write")
        return []

    def write(self, rel: str, text: str) -> None:
        """One planned text into the target, atomically, with the file's mode bits kept; the
        stale bytecode of the module goes with the old text. Only while the path still names
        the tree found (`verify`), and through its handle."""
        self.tree.verify()
        self.tree.replace(rel, text.encode("utf-8"))  # its mode (never setuid) and owner kept
        self.written.add(rel)  # replaced (the rename is its last step that can fail)
        self.tree.drop_pycache(rel)

    def of_this_run(self, files: tuple[FileRecord, ...]) -> tuple[FileRecord, ...]:
        """What a rollback puts back: in the run that wrote, the files it wrote (one it never
        wrote holds what it read, and a link swapped in above it since is not followed to
        look); in another (`recover`), every file of the journal."""
        if not self.originals:
            return files
        return tuple(f for f in files if f.path in self.written)

    def roll_back(self, files: tuple[FileRecord, ...], base: GitBase | None) -> None:
        self.restore_pristine(self.of_this_run(files))

    # ---- revert -----------------------------------------------------------------------
    def check_can_restore(self, files: tuple[FileRecord, ...], base: GitBase | None) -> None:
        """Before the journal: every file not back to the release has a pristine copy to restore."""
        for f in files:
            now = self.tree.sha256(f.path)
            if file_verdict(f, now, self.released(f)) in ("missing", "pristine"):
                continue  # a deleted file is reported, never created; the release's is there
            copy = self.state.copy("pristine", f.path)
            if copy is None or sha256(copy) != f.before:
                raise Refused(
                    f"{self.target.at}: the state of the apply does not match the tree: "
                    f"{f.path} cannot be restored from it",
                    f"restore the file by hand, then move {self.state.dir} aside",
                )
            self.pristine_bytes(f)

    def changes_since_apply(self, base: GitBase | None) -> list[str]:
        """What the user did to this target after the apply besides editing its files."""
        return []

    def finish_revert(
        self, files: tuple[FileRecord, ...], base: GitBase | None, keep_branch: bool
    ) -> str | None:
        self.restore_pristine(files)
        return None

    def settle_after_kill(self, journal: Journal) -> list[str]:
        """Before `recover` finishes a killed run: what the run's tools left (notes)."""
        return []

    def restores(self, files: tuple[FileRecord, ...], base: GitBase | None) -> Restored:
        """What each file will hold once a revert has run (for its dry run): the pristine copy
        where the file is not pristine already."""
        out: Restored = {}
        for f in files:
            verdict = file_verdict(f, self.tree.sha256(f.path), self.released(f))
            if verdict == "missing":
                out[f.path] = None  # deleted: a revert does not create it again
            elif verdict == "pristine":
                out[f.path] = self.tree.read(f.path)
            else:
                try:
                    out[f.path] = self.pristine_bytes(f)
                except Refused:
                    out[f.path] = None
        return out

    def drop_branch(self, base: GitBase | None, keep_branch: bool) -> list[str]:
        return []

    def restore_pristine(self, touched: tuple[FileRecord, ...]) -> None:
        for f in touched:
            path = self.path(f.path)
            if not self.tree.exists(f.path):
                note = f"{path} was deleted; sm120patch does not create it again (reinstall "
                note += f"{self.target.name} {self.target.version} to get it back)"
                if note not in self.notes:
                    self.notes.append(note)
                continue
            if file_verdict(f, self.tree.sha256(f.path), self.released(f)) == "pristine":
                continue  # already the release's bytes
            own = self.originals.get(f.path)
            if own is None or sha256(own) != f.before:
                # Bytes from the state directory (read by path) go only into the tree that
                # path still names; what this run read through the handle goes back through it.
                self.tree.verify()
            data = self.pristine_bytes(f)
            # Over the file that is there, with its own mode: never a mode from the state.
            self.tree.replace(f.path, data)
            self.tree.drop_pycache(f.path)
            interrupts.kill_point("after-write")

    def undo_own_writes(self) -> None:
        """The tree's path names another tree now (`TreeMoved`): put back, through the
        handle only, the bytes this run read there before writing; the state directory,
        reached by path, is left as it is (its journal stays in the tree moved aside)."""
        for rel in sorted(self.written):
            data = self.originals[rel]
            if self.tree.sha256(rel) not in (None, sha256(data)):
                self.tree.replace(rel, data)
                self.tree.drop_pycache(rel)


class GitLayout(InstalledLayout):
    name = "git"

    def __init__(self, target: Target, st: TargetState) -> None:
        super().__init__(target, st)
        self.repo = git.Repo(target.root)
        # Whether this run moved the patch branch: before that, it has nothing to undo.
        self.moved = False

    # ---- apply ------------------------------------------------------------------------
    def check_ready(self, rels: list[str]) -> None:
        self.repo.check_ready(rels)

    def patch_branch(self, profile: str) -> str:
        """`sm120patch/<profile>`, or the first free `sm120patch/<profile>-N`.

        A branch left by `revert --keep-branch` (or a reinstall under it) that carries only
        sm120patch's own commits is reused: it holds nothing of the user's. One with anything
        else, or checked out in another worktree, is left alone and a fresh name is taken.
        """
        base = records.BRANCH_PREFIX + profile
        current = self.repo.branch()
        for n in range(1, 100):
            name = base if n == 1 else f"{base}-{n}"
            if not self.repo.branch_exists(name):
                return name
            if name == current:
                continue  # the commits are built on HEAD: never the branch moved itself
            if self.repo.only_ours(name) and self.repo.worktree_of(name) is None:
                return name
        raise Refused(
            f"{self.target.at}: 99 branches {base}-N exist already",
            f"delete the ones you do not need (`git branch -D {base}-2 ...`)",
        )

    def base(self, patch_branch: str | None) -> GitBase:
        assert patch_branch is not None
        branch, head = self.repo.head()
        return GitBase(branch, head, patch_branch)

    def keeps_pristine(self) -> bool:
        return False  # git restores

    def steps(self, changed: Sequence[FileResult], order: Mapping[str, int]) -> list[Step]:
        """One commit per patch: every patch's text of every file, in profile order."""
        return sorted(
            ((pid, f, text) for f in changed for pid, text in f.step_texts()),
            key=lambda s: order[s[0]],
        )

    def write_all(self, writes: Sequence[Write], base: GitBase | None) -> list[str]:
        """The apply's one transaction on a checkout, as StGit makes it: one commit per step
        built on the journal's HEAD in the object database (nothing of the repository's refs,
        index or work tree changes), the patch branch moved once to the last of them (refused
        when it or HEAD moved under the run), then one checkout of it into the work tree.
        The commits, in order."""
        assert base is not None
        old = self.repo.branch_sha(base.patch_branch)  # a branch kept by an earlier revert
        # git goes by path: only while it names the tree found
        self.tree.verify()
        steps = [(rel, text.encode("utf-8"), message) for rel, text, message in writes]
        commits = self.repo.build_commits(base.head, steps)
        interrupts.kill_point("after-objects")
        rels = sorted({rel for rel, _, _ in writes})
        self._check_unchanged(rels)
        self.tree.verify()
        reason = f"sm120patch: {len(commits)} commits on {base.branch or base.head[:12]}"
        self.repo.move_branch(base.patch_branch, commits[-1], old, base.head, reason)
        self.moved = True
        interrupts.kill_point("after-branch")
        self.tree.verify()
        try:
            self.repo.switch(base.patch_branch, commits[-1])
        except BaseException:
            # What git wrote before it failed is this run's to put back.
            self.written.update(rel for rel in rels if self._changed(rel))
            raise
        self.written.update(rels)
        self._durable(rels)
        for rel in rels:
            self.tree.drop_pycache(rel)
        interrupts.kill_point("after-write")
        return commits

    def _durable(self, rels: list[str]) -> None:
        """git's checkout writes the work tree without fsync: each file it wrote, then each
        of their directories (git makes a new inode), is fsync-ed, so that an apply its
        manifest commits survives a power loss as a write through the handle does. Only an
        fsync, no byte read or written: a name git resolved by path is opened the same way."""
        import posixpath

        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        directories = sorted({posixpath.dirname(rel) or "." for rel in rels})
        for name in [*rels, *directories]:
            try:
                fd = os.open(name, flags, dir_fd=self.tree.fd)
            except OSError:
                continue  # not there (`_verify` says so next)
            try:
                os.fsync(fd)
            except OSError:
                pass  # a file system without fsync
            finally:
                os.close(fd)

    def _check_unchanged(self, rels: list[str]) -> None:
        """Each file still holds what the run read, through the handle: a link inside the
        tree is refused here in one line (git, which goes by path, is never asked to write
        behind one), and a file written since is never checked out over."""
        for rel in rels:
            if self.tree.sha256(rel) != sha256(self.originals[rel]):
                raise Refused(
                    f"{self.path(rel)} changed while sm120patch applied (an editor or an "
                    "install wrote it); nothing was changed",
                    "run the apply again once nothing else is writing the tree",
                )

    def _changed(self, rel: str) -> bool:
        """Whether `rel` no longer holds what the run read (a file behind a link inside the
        tree, which git does not write through, is not this run's)."""
        try:
            return self.tree.sha256(rel) != sha256(self.originals[rel])
        except Refused:
            return False

    def roll_back(self, files: tuple[FileRecord, ...], base: GitBase | None) -> None:
        if base is None or (self.originals and not self.moved):
            return  # the branch never moved in this run: nothing was changed
        current = self.repo.branch()
        mine = self.of_this_run(files)
        if current == base.patch_branch:
            self._switch_back(mine, base)
        else:
            self._undo_checkout(mine)
        self.tree.verify()
        self.repo.delete_branch(base.patch_branch)

    def _undo_checkout(self, files: tuple[FileRecord, ...]) -> None:
        """A checkout that failed, or was killed with git, before it moved HEAD may have
        written some of the files (git writes the work tree, then the index, then HEAD):
        those go back to HEAD's content, the user's branch, which the apply never moved.
        Every touched file was clean when the apply began, under the lock held since."""
        back = [f.path for f in files if self.tree.sha256(f.path) != f.before]
        if back:
            self.tree.verify()
            self.repo.discard(back)

    # ---- revert -----------------------------------------------------------------------
    def undo_own_writes(self) -> None:
        """The branch and commits are git's, reached by path only: the checkout moved aside
        keeps them with its journal, and `recover` there rolls them back by git."""

    def check_can_restore(self, files: tuple[FileRecord, ...], base: GitBase | None) -> None:
        """Before the journal: the revert can be finished by git alone."""
        if base is None:
            return
        self.repo.check_idle()
        for f in files:
            # What git will restore must be in git: a damaged record is refused here, with
            # nothing changed, not found halfway through.
            if self.repo.show(base.patch_branch, f.path) is None:
                raise Refused(
                    f"{self.target.at}: the state of the apply does not match the tree: "
                    f"{f.path} cannot be restored from it",
                    f"restore the file by hand, then move {self.state.dir} aside",
                )
        current = self.repo.branch()
        if current != base.patch_branch:
            return  # nothing to switch; only the branch to drop
        if base.branch is not None and not self.repo.branch_exists(base.branch):
            raise Refused(
                f"{self.target.at}: your branch {base.branch} no longer exists, so there is "
                "nothing to go back to",
                f"finish by hand: `git -C {shlex.quote(str(self.target.root))} checkout -b "
                f"{shlex.quote(base.branch)} {base.head[:12]}` (the commit "
                f"the apply started from), then `sm120patch revert`",
            )
        target = base.branch or base.head
        mine = {f.path for f in files}
        dirty = [p for p in self.repo.dirty_all() if p not in mine]
        crossing = sorted(set(dirty) & set(self.repo.changed_between(base.patch_branch, target)))
        if crossing:
            raise Refused(
                f"{self.target.at}: switching back to {target} would overwrite your "
                "uncommitted changes in " + ", ".join(crossing),
                "commit or stash them (`git stash`), then revert again",
            )

    def changes_since_apply(self, base: GitBase | None) -> list[str]:
        """Commits made on the patch branch after sm120patch's own."""
        if base is None:
            return []
        branch, head = self.repo.head()
        if branch == base.patch_branch and base.commits and head != base.commits[-1]:
            return [f"{base.patch_branch} has commits after sm120patch's ({head[:12]})"]
        return []

    def finish_revert(
        self, files: tuple[FileRecord, ...], base: GitBase | None, keep_branch: bool
    ) -> str | None:
        """Idempotent: run again from the journal, it converges."""
        if base is None:
            return None
        current = self.repo.branch()
        if current == base.patch_branch:
            self._switch_back(files, base)
        self._check_matches_head(files)
        return None

    def settle_after_kill(self, journal: Journal) -> list[str]:
        """[signals] A git killed with the run may have left `index.lock`: removed once the
        run and every git process in the repository are provably gone; then git must be idle
        (no merge or rebase under way) for recover to go on."""
        owner = (journal.pid, journal.pid_start, journal.boot_id)
        self.tree.verify()  # git's locks are removed by path
        notes = [
            f"{self.target.at}: removed {lock}, left by a killed git"
            for lock in self.repo.settle_after_kill(*owner)
        ]
        self.repo.check_idle()
        return notes

    def restores(self, files: tuple[FileRecord, ...], base: GitBase | None) -> Restored:
        """What each file will hold once a revert has run: the content of the branch it
        switches back to (as that branch is now), or, already off the patch branch, what is
        checked out."""
        if base is None:
            return super().restores(files, base)
        current = self.repo.branch()
        if current != base.patch_branch:
            return {f.path: self.repo.show("HEAD", f.path) for f in files}
        back = base.branch or base.head
        return {f.path: self.repo.show(back, f.path) for f in files}

    def drop_branch(self, base: GitBase | None, keep_branch: bool) -> list[str]:
        """Delete the patch branch unless asked to keep it; notes for what could not be."""
        if base is None or keep_branch or not self.repo.branch_exists(base.patch_branch):
            return []
        holder = self.repo.worktree_of(base.patch_branch)
        if holder is not None:
            return [
                f"kept branch {base.patch_branch}: it is checked out in the worktree {holder} "
                f"(delete it there: `git -C {holder} switch --detach && git -C {holder} "
                f"branch -D {base.patch_branch}`)"
            ]
        if not self.repo.only_ours(base.patch_branch):
            return [
                f"kept branch {base.patch_branch}: it has commits that are not sm120patch's"
            ]
        self.tree.verify()
        self.repo.delete_branch(base.patch_branch)
        return []

    def _switch_back(self, files: tuple[FileRecord, ...], base: GitBase) -> None:
        # Reset our files to the patch branch so the switch is clean (a revert with edits
        # there got --force); other dirty files ride along untouched.
        self.tree.verify()
        self.repo.discard([f.path for f in files])
        interrupts.kill_point("during-switch")
        self.tree.verify()
        self.repo.switch(base.branch, base.head)
        interrupts.kill_point("after-switch")

    def _check_matches_head(self, files: tuple[FileRecord, ...]) -> None:
        """Every touched file equals the checked-out branch's content (git restored it)."""
        for f in files:
            blob = self.repo.show("HEAD", f.path)
            data = self.tree.read(f.path) if self.tree.is_regular(f.path) else None
            if blob != data:
                branch, head = self.repo.head()
                root = shlex.quote(str(self.target.root))
                raise Refused(
                    f"{self.target.at}: after switching back to {branch or head[:12]}, "
                    f"{f.path} differs from that branch's content",
                    f"inspect it (`git -C {root} diff HEAD -- {shlex.quote(f.path)}`); "
                    f"`git -C {root} checkout HEAD -- {shlex.quote(f.path)}` "
                    "restores the branch's version",
                )


def layout_of(target: Target, st: TargetState) -> TargetLayout:
    return GitLayout(target, st) if target.layout == "git" else InstalledLayout(target, st)
