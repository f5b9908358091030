"""Everything that touches git. The one place branches are made; the only module importing git.

GitPython is imported lazily so commands that never touch git (`list`, `status`) start fast.
Every git command runs without hooks (`core.hooksPath=/dev/null`: no pre-commit, post-commit,
post-checkout nor reference-transaction hook), without fsmonitor, signing or automatic gc
(`SAFE_CONFIG`): a checkout's hooks and configuration are code of its owner's, which must not
run in sm120patch's process (often root's), reformat the files just verified, or block an
unattended run on a prompt. A checkout owned by another user than the one running sm120patch
is refused (`check_owner`) before any git command runs in it.

Every git child runs in a session of its own (`start_new_session`): a Ctrl-C in the terminal,
or a closed terminal, signals the terminal's foreground process group, and a git killed
half-way through a checkout leaves a half-switched work tree and its `index.lock`. sm120patch
defers those signals itself (`interrupts.py`) and lets each git command finish.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sm120patch.errors import Refused
from sm120patch.targets import procscan

if TYPE_CHECKING:
    import git

FALLBACK_NAME = "sm120patch"
FALLBACK_EMAIL = "sm120patch@localhost"
# How long `recover` waits for a git command still running in the repository (a child of the
# killed run, which outlives it in its own session) before it refuses.
SETTLE_WAIT_S = 10.0
# `-c` options given to every git command sm120patch runs (they override every config file).
SAFE_CONFIG = (
    "-c", "core.hooksPath=/dev/null",
    "-c", "core.fsmonitor=false",
    "-c", "commit.gpgSign=false",
    "-c", "tag.gpgSign=false",
    "-c", "gc.auto=0",
    "-c", "maintenance.auto=false",
)  # fmt: skip


def check_owner(root: Path) -> None:
    """Refuse a checkout owned by another user than the effective one: its hooks, filters
    and configuration would run as this user (root, under sudo). git's own `safe.directory`
    check lets root through under sudo; sm120patch does not."""
    uid = os.geteuid()
    for path in (root, root / ".git"):
        try:
            owner = os.stat(path).st_uid
        except OSError:
            continue
        if owner != uid:
            from sm120patch.targets.files import owner_name

            raise Refused(
                f"{root} is a git checkout owned by another user ({owner_name(owner)}), not "
                f"by {owner_name(uid)}, who runs sm120patch: its hooks and configuration are "
                "its owner's code, which sm120patch does not run",
                f"run sm120patch as {owner_name(owner)} (`sudo -u {owner_name(owner)} "
                "sm120patch ...`)",
            )


def work_tree_of(path: Path) -> Path | None:
    """The root of the git work tree holding `path`, or None (found without running git)."""
    for directory in (path, *path.parents):
        if (directory / ".git").exists():
            return directory
    return None


def git_dir_of(root: Path) -> Path:
    """The git directory of a work tree: `.git`, or where a `.git` file points (worktrees)."""
    dot = root / ".git"
    if dot.is_file():
        text = dot.read_text(encoding="utf-8", errors="replace").strip()
        if text.startswith("gitdir:"):
            target = Path(text.split(":", 1)[1].strip())
            return target if target.is_absolute() else (root / target).resolve()
    return dot


def head_branch(root: Path) -> str | None:
    """The branch checked out in the work tree at `root` (None: detached or unreadable), read
    from its HEAD file without running git: `status` stays a process without git."""
    try:
        text = (git_dir_of(root) / "HEAD").read_text(encoding="utf-8").strip()
    except OSError:
        return None
    prefix = "ref: refs/heads/"
    return text[len(prefix) :] if text.startswith(prefix) else None


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


def describe_version(root: Path) -> str | None:
    try:
        described = _own_session_repo()(root).git.describe("--tags", "--match", "v*")
    except Exception:  # no tags, no git binary, odd repository: the caller reports "unknown"
        return None
    return version_from_describe(described)


_DESCRIBE = re.compile(
    r"^v?(?P<tag>\d+(?:\.\d+)*(?:\.post\d+)?)(?:-(?P<n>\d+)-g(?P<sha>[0-9a-f]+))?$"
)


def version_from_describe(described: str) -> str | None:
    """`v0.5.9` -> 0.5.9; `v0.5.9-12-gabc123` -> 0.5.9+12.gabc123 (a local version of 0.5.9)."""
    match = _DESCRIBE.match(described.strip())
    if not match:
        return None
    if match["n"]:
        return f"{match['tag']}+{match['n']}.g{match['sha']}"
    return match["tag"]


def is_tracked(root: Path, path: Path) -> bool:
    """Whether git tracks `path`; refuses a repository git itself will not work in, rather
    than silently treating the checkout as an installed package.

    Runs git directly instead of through GitPython: this is the only git call `status` makes,
    and importing GitPython would double that command's start-up time.
    """
    import subprocess

    rel = str(path.relative_to(root))
    try:
        proc = subprocess.run(
            [
                "git",
                *SAFE_CONFIG,
                "--literal-pathspecs",
                "-C",
                str(root),
                "ls-files",
                "--error-unmatch",
                "--",
                rel,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as exc:
        raise Refused(
            f"cannot run git for {root} ({exc.strerror})",
            "install git, or point sm120patch at an installed package",
        ) from None
    if proc.returncode == 0:
        return True
    if "dubious ownership" in proc.stderr:
        raise Refused(
            f"git refuses to work in {root}: it is owned by another user",
            "run sm120patch as the checkout's owner",
        )
    if "not a git repository" in proc.stderr:
        raise Refused(
            f"{root}/.git is not a usable git repository",
            "repair or remove it, then run sm120patch again",
        )
    return False


def _git_problem(exc: Exception) -> str:
    """The line of a git error that says what went wrong."""
    text = str(getattr(exc, "stderr", "") or exc).strip().strip("'").strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    fatal = [line for line in lines if line.startswith(("fatal:", "error:"))]
    return (fatal or lines or [type(exc).__name__])[0].removeprefix("stderr: ")


_repo_class: type[git.Repo] | None = None


def _own_session_repo() -> type[git.Repo]:
    """`git.Repo` whose every git child starts in a session of its own, the persistent
    `git cat-file` processes included (they are started through `Git.execute` too).

    `Git.execute` hands its extra keyword arguments to `subprocess.Popen` (GitPython 3.1 and
    3.2: `**subprocess_kwargs`), but `repo.git.<command>(...)` turns unknown keywords into git
    options, so the default is set in `execute` itself, through `Repo.GitCommandWrapperType`.
    """
    global _repo_class
    if _repo_class is None:
        import git

        class OwnSessionGit(git.Git):
            def execute(self, command, *args, **kwargs):  # type: ignore[no-untyped-def]
                kwargs.setdefault("start_new_session", True)
                if (
                    isinstance(command, (list, tuple))
                    and len(command) > 1
                    and command[0] in ("git", self.GIT_PYTHON_GIT_EXECUTABLE)
                ):
                    # No hook, fsmonitor, signing or gc: whatever the repository says.
                    command = [command[0], *SAFE_CONFIG, *command[1:]]
                with _terminal_signals_blocked():
                    return super().execute(command, *args, **kwargs)

        class OwnSessionRepo(git.Repo):
            GitCommandWrapperType = OwnSessionGit

        _repo_class = OwnSessionRepo
    return _repo_class


@contextmanager
def _terminal_signals_blocked() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP blocked in this thread around a git command.

    The child is in the terminal's process group from the fork until its `setsid`; a Ctrl-C
    in that window stays pending in it and kills git once the child unblocks it, before the
    exec (a rollback's `git branch -D` died so, exit -2). The child inherits the mask, so the
    signal stays blocked in git, whose own session no terminal signal reaches anyway. Here it
    stays pending too, and reaches the handler (`interrupts.py`) when the command returns:
    deferred, never lost."""
    import signal

    signals = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Repo:
    """The git side of one target."""

    def __init__(self, root: Path) -> None:
        import git

        try:
            self.repo: git.Repo = _own_session_repo()(root)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            raise Refused(
                f"{root} is not a usable git repository",
                f"`git -C {shlex.quote(str(root))} status` says what is wrong; or give the "
                "installed package",
            ) from None
        if self.repo.bare:
            raise Refused(f"{root} is a bare git repository", "patch a checkout with a work tree")
        # Paths come from the plan and from state: never let one be read as pathspec magic.
        self.repo.git.update_environment(GIT_LITERAL_PATHSPECS="1")
        self.root = root

    @contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """A failed git command becomes one line saying which and why (never a traceback)."""
        import git

        try:
            yield
        except git.GitCommandError as exc:
            raise Refused(
                f"git {what} failed in {self.root}: {_git_problem(exc)}",
                "fix what git says; if sm120patch was interrupted, `sm120patch recover` "
                "finishes its work afterwards",
            ) from None

    # ---- reading -----------------------------------------------------------------------
    def head(self) -> tuple[str | None, str]:
        """(current branch or None when detached, HEAD commit)."""
        import git

        try:
            sha = self._head_sha()
        except ValueError:
            raise Refused(f"{self.root} has no commit yet", "commit the tree first") from None
        try:
            branch: str | None = self.repo.active_branch.name
        except TypeError:  # detached HEAD
            branch = None
        except git.GitCommandError:
            branch = None
        return branch, sha

    def _head_sha(self) -> str:
        """HEAD's commit id. GitPython reads objects through a long-lived `git cat-file`; if
        that process died (a signal sent to a whole control group, an OOM kill), start it
        again once instead of failing a rollback with "Broken pipe"."""
        try:
            return self.repo.head.commit.hexsha
        except (BrokenPipeError, ValueError):
            # ValueError is also "no commit yet": the second try raises it again.
            self.repo.git.clear_cache()
            return self.repo.head.commit.hexsha

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
        git_dir = Path(self.repo.git_dir)
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
        return sorted({Path(self.repo.git_dir), Path(self.repo.common_dir)})

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
        with self._failing("status"):
            out = self.repo.git.status("--porcelain", "--untracked-files=all", "--", *rels)
        return sorted({line[3:] for line in out.splitlines() if line.strip()})

    def branch_exists(self, name: str) -> bool:
        return name in [h.name for h in self.repo.heads]

    def show(self, rev: str, rel: str) -> bytes | None:
        import git

        try:
            data = self.repo.git.execute(
                ["git", "show", f"{rev}:{rel}"],
                stdout_as_string=False,
                strip_newline_in_stdout=False,
            )
        except git.GitCommandError:
            return None
        assert isinstance(data, bytes)  # stdout_as_string=False
        return data

    def dirty_all(self) -> list[str]:
        """Every tracked file with uncommitted changes (paths relative to the root)."""
        with self._failing("status"):
            out = self.repo.git.status("--porcelain", "--untracked-files=no")
        return sorted({line[3:] for line in out.splitlines() if line.strip()})

    def changed_between(self, a: str, b: str) -> list[str]:
        with self._failing("diff"):
            out = self.repo.git.diff("--name-only", a, b, "--")
        return [line for line in out.splitlines() if line]

    def only_ours(self, branch: str) -> bool:
        """Whether every commit of `branch` not on any other branch is one of sm120patch's."""
        others = [f"^{h.name}" for h in self.repo.heads if h.name != branch]
        with self._failing("log"):
            out = self.repo.git.log("--format=%H%x00%B%x01", branch, *others, "--")
        commits = [c for c in out.split("\x01") if c.strip()]
        return all("Sm120patch-Patch:" in c for c in commits)

    def worktree_of(self, branch: str) -> Path | None:
        """Another worktree that has `branch` checked out (git refuses to delete it then)."""
        with self._failing("worktree list"):
            out = self.repo.git.worktree("list", "--porcelain")
        path: Path | None = None
        for line in out.splitlines():
            if line.startswith("worktree "):
                path = Path(line.removeprefix("worktree "))
            elif line == f"branch refs/heads/{branch}" and path is not None:
                if path.resolve() != self.root.resolve():
                    return path
        return None

    # ---- writing -----------------------------------------------------------------------
    def create_branch_here(self, name: str, *, reset: bool = False) -> None:
        """Make `name` at HEAD and switch to it; uncommitted changes of other files stay.

        `reset`: the branch exists and carries only sm120patch's commits: move it here.
        """
        with self._failing("checkout -b"):
            self.repo.git.checkout("-B" if reset else "-b", name)

    def switch(self, branch: str | None, sha: str) -> None:
        with self._failing("checkout"):
            if branch:
                self.repo.git.checkout(branch, "--")
            else:
                self.repo.git.checkout("--detach", sha, "--")

    def discard(self, rels: list[str]) -> None:
        """Reset files to HEAD (only ever called on files whose edits the user chose to drop)."""
        if rels:
            with self._failing("checkout HEAD --"):
                self.repo.git.checkout("HEAD", "--", *rels)

    def delete_branch(self, name: str) -> None:
        if self.branch_exists(name):
            with self._failing("branch -D"):
                self.repo.git.branch("-D", name, "--")

    def commit(self, rels: list[str], message: str) -> str:
        with self._failing("commit"):
            return self._commit(rels, message)

    def _commit(self, rels: list[str], message: str) -> str:
        self.repo.git.add("--", *rels)
        self.repo.git.execute(
            [
                "git",
                "commit",
                "--no-verify",
                "-q",
                "-m",
                message,
                "--",
                *rels,
            ],
            env=self._identity_env(),
        )
        return self._head_sha()

    def _identity_env(self) -> dict[str, str]:
        """The user's git identity when configured, else a clear fallback (never a prompt)."""
        reader = self.repo.config_reader()
        env: dict[str, str] = {}
        name = reader.get_value("user", "name", default="") or os.environ.get("GIT_AUTHOR_NAME")
        email = reader.get_value("user", "email", default="") or os.environ.get("GIT_AUTHOR_EMAIL")
        if not name:
            env["GIT_AUTHOR_NAME"] = env["GIT_COMMITTER_NAME"] = FALLBACK_NAME
        if not email:
            env["GIT_AUTHOR_EMAIL"] = env["GIT_COMMITTER_EMAIL"] = FALLBACK_EMAIL
        return env
