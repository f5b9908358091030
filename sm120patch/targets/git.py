"""Everything that writes with git. The one place branches are made.

An apply's commits are built in the object database with an index of their own
(`Repo.build_commits`), the patch branch is moved once, in one ref transaction that refuses
a branch or HEAD moved under the run (`Repo.move_branch`, as StGit moves a stack), and the
work tree is then checked out once (`Repo.switch`).

Every git command runs through `targets.run_git` (the one runner, beside the read-only git
that finding a target needs), without hooks (`core.hooksPath=/dev/null`: no pre-commit,
post-commit, post-checkout nor reference-transaction hook), without fsmonitor, signing or
automatic gc (`SAFE_CONFIG`): a checkout's hooks and configuration are code of its owner's,
which must not run in sm120patch's process (often root's), reformat the files just verified,
or block an unattended run on a prompt. A checkout owned by another user than the one running
sm120patch is refused (`targets.check_owner`) before any git command runs in it.

Git also runs with no configuration but the repository's own and no code of anyone's: a clean
environment (`git_env`: no system or global config, no `HOME` to find one in, no `GIT_*` of the
caller's), no attributes file, and every filter driver the repository's config defines switched
off (`_filters_off`), so no clean, smudge or process filter runs whatever `.gitattributes` or
`$GIT_DIR/info/attributes` assign. (root run with a user's HOME used to run that user's
`~/.gitconfig` filters.) Every git child is started through `/usr/bin/env -i`.

Every git child runs in a session of its own (`start_new_session`): a Ctrl-C in the terminal,
or a closed terminal, signals the terminal's foreground process group, and a git killed
half-way through a checkout leaves a half-switched work tree and its `index.lock`. sm120patch
defers those signals itself (`interrupts.py`) and lets each git command finish. No git process
outlives its command (GitPython's long-lived `cat-file`, which a signal to the whole control
group killed under a rollback, is gone with GitPython).
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sm120patch.errors import Refused
from sm120patch.targets import PATCH_TRAILER, procscan, run_git
from sm120patch.targets import git_dir_of as git_dir_of  # read without git: with finding
from sm120patch.targets import head_branch as head_branch

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Sequence

FALLBACK_NAME = "sm120patch"
FALLBACK_EMAIL = "sm120patch@localhost"
# How long `recover` waits for a git command still running in the repository (a child of the
# killed run, which outlives it in its own session) before it refuses.
SETTLE_WAIT_S = 10.0
# The caller's identity for sm120patch's commits, when set (data, never code).
_IDENTITY_ENV = ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL")


def _filters_off(root: Path) -> tuple[dict[str, str], bool]:
    """`GIT_CONFIG_*` settings (command-line scope, above every file) that switch off every
    filter driver the repository's configuration defines: with `process` empty git uses
    neither it nor `clean`/`smudge`, and a driver no longer `required` is skipped. The
    attributes that name a driver (`.gitattributes`, `info/attributes`) then do nothing.
    And whether the configuration says the repository is bare (`core.bare`), read by the
    same git command."""
    proc = run_git(root, "config", "-z", "--get-regexp", r"^filter\.|^core\.bare$")
    names = set()
    bare = False
    # `-z`: "key\nvalue", or "key" alone for no value
    for entry in proc.stdout.decode("utf-8", "replace").split("\0"):
        key, newline, value = entry.partition("\n")
        if key.lower() == "core.bare":  # git's booleans: no value is true
            v = value.strip().lower()
            bare = not newline or v in ("true", "yes", "on") or (v.isdigit() and int(v) != 0)
            continue
        section, _, rest = key.partition(".")
        name, _, _key = rest.rpartition(".")
        if section == "filter" and name:
            names.add(name)
    env: dict[str, str] = {}
    off = (("process", ""), ("clean", ""), ("smudge", ""), ("required", "false"))
    pairs = [(f"filter.{n}.{k}", v) for n in sorted(names) for k, v in off]
    for i, (key, value) in enumerate(pairs):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    if pairs:
        env["GIT_CONFIG_COUNT"] = str(len(pairs))
    return env, bare


def _common_dir(root: Path) -> Path:
    """The git directory shared by every worktree (where refs live)."""
    git_dir = git_dir_of(root)
    try:
        common = (git_dir / "commondir").read_text(encoding="utf-8").strip()
    except OSError:
        return git_dir
    path = Path(common)
    return path if path.is_absolute() else (git_dir / path).resolve()


def branch_exists_light(root: Path, name: str) -> bool:
    """Whether `refs/heads/<name>` exists (loose or packed), without running git."""
    common = _common_dir(root)
    if (common / "refs" / "heads" / name).is_file():
        return True
    try:
        packed = (common / "packed-refs").read_text(encoding="utf-8")
    except OSError:
        return False
    return any(line.endswith(f" refs/heads/{name}") for line in packed.splitlines())


def branch_sha_light(root: Path, name: str) -> str | None:
    """The commit `refs/heads/<name>` points at (loose or packed), without running git; None
    when the branch does not exist or its ref cannot be read."""
    common = _common_dir(root)
    try:
        return (common / "refs" / "heads" / name).read_text(encoding="utf-8").strip() or None
    except OSError:
        pass
    try:
        packed = (common / "packed-refs").read_text(encoding="utf-8")
    except OSError:
        return None
    for line in packed.splitlines():
        sha, _, ref = line.partition(" ")
        if ref == f"refs/heads/{name}":
            return sha
    return None


def _git_problem(stderr: str) -> str:
    """The line of git's error output that says what went wrong ('' where it says nothing)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    fatal = [line for line in lines if line.startswith(("fatal:", "error:"))]
    return (fatal or lines or [""])[0]


def _unusable(root: Path) -> Refused:
    return Refused(
        f"{root} is not a usable git repository",
        f"`git -C {shlex.quote(str(root))} status` says what is wrong; or give the "
        "installed package",
    )


def _bare(root: Path) -> Refused:
    return Refused(f"{root} is a bare git repository", "patch a checkout with a work tree")


def _failed(what: str, root: Path, problem: str) -> Refused:
    """A failed git command, in one line that says which and why (never a traceback)."""
    return Refused(
        f"git {what} failed in {root}: {problem}",
        "fix what git says; if sm120patch was interrupted, `sm120patch recover` "
        "finishes its work afterwards",
    )


def stripspace(message: str) -> str:
    """`message` as `git commit -m` records it (git's whitespace clean-up, which
    `commit-tree` does not make): each line's trailing whitespace dropped, runs of blank lines
    made one, none at either end, one newline at the end."""
    lines: list[str] = []
    for line in message.splitlines():
        line = line.rstrip()
        if line or (lines and lines[-1]):
            lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n" if lines else ""


class Repo:
    """The git side of one target: its commands run by `targets.run_git`, with the
    repository's filter drivers off and paths taken literally."""

    def __init__(self, root: Path) -> None:
        if not (git_dir_of(root) / "HEAD").is_file():
            raise _unusable(root)
        # No filter driver of the repository's config runs (the module's docstring).
        filters_off, bare = _filters_off(root)
        if bare:
            raise _bare(root)
        self.root = root
        self._environment = filters_off

    def _run(
        self, what: str, *args: str, env: dict[str, str] | None = None, stdin: bytes | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """A git command that must succeed: a failure is one line saying which and why
        (`_failed`), never a traceback."""
        proc = run_git(self.root, *args, env={**self._environment, **(env or {})}, stdin=stdin)
        if proc.returncode != 0:
            stderr = proc.stderr.decode("utf-8", "replace")
            raise _failed(what, self.root, _git_problem(stderr) or f"exit {proc.returncode}")
        return proc

    def _read(
        self, what: str, *args: str, env: dict[str, str] | None = None, stdin: bytes | None = None
    ) -> str:
        """A git command's output, its last newline dropped."""
        out = self._run(what, *args, env=env, stdin=stdin).stdout.decode("utf-8", "replace")
        return out[:-1] if out.endswith("\n") else out

    # ---- reading -----------------------------------------------------------------------
    def head(self) -> tuple[str | None, str]:
        """(current branch or None when detached, HEAD commit)."""
        return head_branch(self.root), self._head_sha()

    def branch(self) -> str | None:
        """The current branch, None when detached: read from HEAD, no git process (a dry run
        on a checkout runs no more git than it must)."""
        return head_branch(self.root)

    def _head_sha(self) -> str:
        """HEAD's commit id."""
        proc = run_git(self.root, "rev-parse", "--verify", "-q", "HEAD^{commit}",
                       env=self._environment)
        if proc.returncode != 0:
            raise Refused(f"{self.root} has no commit yet", "commit the tree first")
        return proc.stdout.decode("ascii", "replace").strip()

    def check_ready(self, rels: list[str]) -> None:
        """Refuse when the repository is mid-operation or a file we would touch is not clean."""
        self.check_idle()
        dirty = self.dirty(rels)
        if dirty:
            raise Refused(
                f"{self.root}: uncommitted changes in files this profile touches: "
                + ", ".join(dirty),
                "commit or stash them (`git stash`), then run sm120patch again",
            )

    def check_idle(self) -> None:
        """Refuse when git is mid-operation: a merge, rebase, ... or another git command."""
        git_dir = git_dir_of(self.root)
        lock = git_dir / "index.lock"
        if lock.exists():
            raise Refused(
                f"{lock} exists: another git command is running in {self.root}, or one was killed",
                f"if no git command is running there, remove {lock}, then run sm120patch again",
            )
        for marker, what in (
            ("MERGE_HEAD", "a merge"),
            ("rebase-merge", "a rebase"),
            ("rebase-apply", "a rebase or am"),
            ("CHERRY_PICK_HEAD", "a cherry-pick"),
            ("REVERT_HEAD", "a revert"),
            ("BISECT_LOG", "a bisect"),
        ):
            if (git_dir / marker).exists():
                raise Refused(
                    f"{self.root} is in the middle of {what}",
                    "finish or abort it, then run sm120patch again",
                )

    # ---- after a killed run (recover) ---------------------------------------------------
    def _git_dirs(self) -> list[Path]:
        """The per-worktree git directory and the common one (the same outside worktrees)."""
        return sorted({git_dir_of(self.root), _common_dir(self.root)})

    def lock_files(self) -> list[Path]:
        """The lock files a killed git leaves behind: `index.lock`, `HEAD.lock`,
        `packed-refs.lock`, a branch's `refs/heads/<name>.lock`."""
        found: set[Path] = set()
        for directory in self._git_dirs():
            found.update(directory.glob("*.lock"))
            if (directory / "refs").is_dir():
                found.update((directory / "refs").rglob("*.lock"))
        return sorted(found)

    def settle_after_kill(self, pid: int, start: str | None, boot: str | None) -> list[Path]:
        """Make the repository usable for `recover` after the run that journaled was killed.

        `pid`, `start`, `boot`: the journal's record of the run that wrote it (its pid, start
        time and boot id, `procscan.identity()`). That run must be dead (so a reused pid is not
        mistaken for it), and no process may be working in the git directory (a file open
        there, or its cwd).
        While git left a lock file, no git process may be working in the work tree either: a
        git child of the killed run, which outlives it in its own session, gets SETTLE_WAIT_S
        to finish. Then every lock file left is stale: it is removed, and returned.
        Refuses while the run or such a process is alive, or, with a lock present, when
        /proc cannot show either. An idle git elsewhere in the work tree (an editor's, a
        pager's) does not stop a recover that has no lock to remove.
        """
        if procscan.alive(pid, start, boot):
            raise Refused(
                f"the sm120patch run that left the journal on {self.root} (pid {pid}) is "
                "still running",
                "wait for it to end (or stop it), then run `sm120patch recover` again",
            )
        if not procscan.available():
            locks = self.lock_files()
            if locks:
                raise Refused(
                    f"{locks[0]} exists, and without /proc sm120patch cannot tell whether a "
                    f"git command is still running in {self.root}",
                    f"if none is, remove {' '.join(str(lock) for lock in locks)}, then run "
                    "`sm120patch recover` again",
                )
            return []
        deadline = time.monotonic() + SETTLE_WAIT_S
        while True:
            locks = self.lock_files()
            users = procscan.users_of(self._git_dirs(), self.root if locks else None)
            if not users:
                break
            if time.monotonic() >= deadline:
                held = f" ({locks[0].name} is there)" if locks else ""
                raise Refused(
                    f"a git command is still running in {self.root}{held}: "
                    + "; ".join(u.describe() for u in users),
                    "let it finish (or stop it), then run `sm120patch recover` again",
                )
            time.sleep(0.05)
        for lock in locks:
            lock.unlink(missing_ok=True)
        return locks

    def dirty(self, rels: list[str]) -> list[str]:
        if not rels:
            return []
        out = self._read("status", "status", "--porcelain", "--untracked-files=all", "--", *rels)
        return sorted({line[3:] for line in out.splitlines() if line.strip()})

    def branch_exists(self, name: str) -> bool:
        return branch_exists_light(self.root, name)

    def branch_sha(self, name: str) -> str | None:
        """The commit `name` points at (None: no such branch)."""
        return branch_sha_light(self.root, name)

    def show(self, rev: str, rel: str) -> bytes | None:
        proc = run_git(self.root, "show", f"{rev}:{rel}", env=self._environment)
        return proc.stdout if proc.returncode == 0 else None

    def dirty_all(self) -> list[str]:
        """Every tracked file with uncommitted changes (paths relative to the root)."""
        out = self._read("status", "status", "--porcelain", "--untracked-files=no")
        return sorted({line[3:] for line in out.splitlines() if line.strip()})

    def changed_between(self, a: str, b: str) -> list[str]:
        out = self._read(
            "diff", "diff", "--no-ext-diff", "--no-textconv", "--name-only", a, b, "--"
        )
        return [line for line in out.splitlines() if line]

    def only_ours(self, branch: str) -> bool:
        """Whether every commit of `branch` not on any other branch is one of sm120patch's."""
        heads = self._read(
            "for-each-ref", "for-each-ref", "--format=%(refname:short)", "refs/heads/"
        ).splitlines()
        others = [f"^{h}" for h in heads if h and h != branch]
        out = self._read("log", "log", "--format=%H%x00%B%x01", branch, *others, "--")
        commits = [c for c in out.split("\x01") if c.strip()]
        return all(PATCH_TRAILER in c for c in commits)

    def worktree_of(self, branch: str) -> Path | None:
        """Another worktree that has `branch` checked out (git refuses to delete it then)."""
        out = self._read("worktree list", "worktree", "list", "--porcelain")
        path: Path | None = None
        for line in out.splitlines():
            if line.startswith("worktree "):
                path = Path(line.removeprefix("worktree "))
            elif line == f"branch refs/heads/{branch}" and path is not None:
                if path.resolve() != self.root.resolve():
                    return path
        return None

    # ---- writing -----------------------------------------------------------------------
    def build_commits(self, parent: str, steps: Sequence[tuple[str, bytes, str]]) -> list[str]:
        """One commit per step, each on the one before and the first on `parent`: a step is
        (a tracked file's path, its bytes after the step, the commit message). Made in the
        object database alone, through an index of its own in a private temporary directory
        (`GIT_INDEX_FILE`): `read-tree`, then per step `hash-object -w`, `update-index`,
        `write-tree`, `commit-tree`. No ref, neither the repository's index nor its work tree
        changes: a kill here leaves only objects nothing points at (git's gc prunes them)."""
        import tempfile

        rels = sorted({rel for rel, _, _ in steps})
        commits: list[str] = []
        with tempfile.TemporaryDirectory(prefix="sm120patch-index-") as private:
            index = {"GIT_INDEX_FILE": os.path.join(private, "index")}
            self._run("read-tree", "read-tree", parent, env=index)
            modes = self._modes(rels, index)
            for rel, data, message in steps:
                # `--path`: the repository's attributes apply as `git add` would apply them.
                hashed = ("hash-object", "-w", f"--path={rel}", "--stdin")
                blob = self._read("hash-object", *hashed, stdin=data)
                entry = f"{modes[rel]},{blob},{rel}"
                self._run("update-index", "update-index", "--cacheinfo", entry, env=index)
                tree = self._read("write-tree", "write-tree", env=index)
                text = stripspace(message).encode("utf-8")
                made = ("commit-tree", tree, "-p", parent)
                parent = self._read("commit-tree", *made, env=self._identity(), stdin=text)
                commits.append(parent)
        return commits

    def _modes(self, rels: list[str], index: dict[str, str]) -> dict[str, str]:
        """Each file's mode in the index `index` names (100644, 100755); a file it does not
        track is refused (the apply's preflight refuses untracked files first)."""
        out = self._read("ls-files", "ls-files", "-s", "-z", "--", *rels, env=index)
        modes: dict[str, str] = {}
        for entry in out.split("\0"):
            info, tab, path = entry.partition("\t")
            if tab:
                modes[path] = info.split(" ")[0]
        for rel in rels:
            if rel not in modes:
                raise Refused(
                    f"{self.root}: {rel} is not tracked by git",
                    f"commit it first (`git -C {shlex.quote(str(self.root))} add "
                    f"{shlex.quote(rel)}`), then run sm120patch again",
                )
        return modes

    def move_branch(self, name: str, new: str, old: str | None, head: str, reason: str) -> None:
        """Point `refs/heads/<name>` at `new` in one ref transaction (`update-ref --stdin`), as
        StGit moves a stack: only while the branch still is `old` (None: does not exist) and
        HEAD still is `head`; a branch or HEAD moved under the run is a refusal, with nothing
        moved. Its reflog gets one entry, `reason`."""
        ref = f"refs/heads/{name}"
        move = f"create {ref} {new}" if old is None else f"update {ref} {new} {old}"
        lines = f"verify HEAD {head}\n{move}\n".encode("ascii")
        moved = ("update-ref", "-m", reason, "--stdin")
        proc = run_git(self.root, *moved, env=self._environment, stdin=lines)
        if proc.returncode != 0:
            problem = _git_problem(proc.stderr.decode("utf-8", "replace"))
            raise Refused(
                f"{self.root}: {name} or HEAD moved while sm120patch built its commits, or "
                f"another git command holds a lock there ({problem or 'update-ref failed'}); "
                "nothing was changed",
                "run sm120patch again once no other git command runs there",
            )

    def switch(self, branch: str | None, sha: str) -> None:
        if branch:
            self._run("checkout", "checkout", branch, "--")
        else:
            self._run("checkout", "checkout", "--detach", sha, "--")

    def discard(self, rels: list[str]) -> None:
        """Reset files to HEAD (only ever called on files whose edits the user chose to drop)."""
        if rels:
            self._run("checkout HEAD --", "checkout", "HEAD", "--", *rels)

    def delete_branch(self, name: str) -> None:
        if self.branch_exists(name):
            self._run("branch -D", "branch", "-D", name, "--")

    def _local_config(self, key: str) -> str:
        """The repository's own value of `key` ('' when unset: exit 1)."""
        proc = run_git(self.root, "config", "--local", "--get", key, env=self._environment)
        return proc.stdout.decode("utf-8", "replace").strip() if proc.returncode == 0 else ""

    def _identity(self) -> dict[str, str]:
        """`_identity_env`, read once per repository (two git commands, not two a commit)."""
        if not hasattr(self, "_identity_read"):
            self._identity_read = self._identity_env()
        return self._identity_read

    def _identity_env(self) -> dict[str, str]:
        """The identity of sm120patch's commits: `GIT_AUTHOR_*`/`GIT_COMMITTER_*` when set,
        else the repository's `user.name`/`user.email`, else a clear fallback (never a prompt).
        Git sees no global configuration (`git_env`), so the identity is always given.
        Read by `git config --local`."""
        name = self._local_config("user.name") or FALLBACK_NAME
        email = self._local_config("user.email") or FALLBACK_EMAIL
        env = {
            "GIT_AUTHOR_NAME": name,
            "GIT_COMMITTER_NAME": name,
            "GIT_AUTHOR_EMAIL": email,
            "GIT_COMMITTER_EMAIL": email,
        }
        env.update({k: os.environ[k] for k in _IDENTITY_ENV if os.environ.get(k)})
        return env
