"""Bad input corpus: every kind of broken, odd or hostile input a user can
hand sm120patch. Each refusal is exactly one line on stderr (`sm120patch: ...`, plus an
optional `  next: ...`), the documented exit code (1 refused, 2 usage), no traceback, and
every tree byte-identical before and after. The inputs sm120patch must handle (CRLF, tabs,
detached HEAD, shallow clone, read-only file, stale lock) apply and revert byte-exact."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from killing import write_patches
from trees import git, make_tree, tree_hash

from sm120patch.cli import main

SERVER_ARGS = "sglang/srt/server_args.py"
COMMUNICATOR = "sglang/srt/layers/communicator.py"
COMM = "flashinfer/jit/comm.py"


@dataclass
class Case:
    args: list[str]
    roots: list[Path]
    code: int
    needle: str
    # Patches applied around the run (mock), undone before the trees are hashed again.
    patches: list[Callable[[], object]] = field(default_factory=list)


def snapshot(root: Path) -> str:
    """tree_hash, or where git cannot read the repository, every file's bytes (git's index
    excepted: `git status` may refresh its stat cache)."""
    try:
        return tree_hash(root)
    except subprocess.CalledProcessError:
        h = hashlib.sha256()
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root).as_posix()
            lock = rel.startswith(".git/sm120patch/") and rel.endswith("/lock")
            if path.is_file() and rel != ".git/index" and not lock:
                h.update(rel.encode() + b"\0" + path.read_bytes())
        return h.hexdigest()


def journals(roots: list[Path]) -> dict[Path, bytes]:
    """Every journal in the state of `roots` (checkouts and installed packages) and in the
    user state directory (where 0.1.0 kept it)."""
    found = [*Path(os.environ["SM120PATCH_STATE_DIR"]).rglob("journal.json")]
    for r in roots:
        found += [*r.glob(".git/sm120patch/*/journal.json"), *r.glob(".sm120patch/*/journal.json")]
    return {j: j.read_bytes() for j in found if j.is_file()}


def invoke(args: list[str]):
    return CliRunner().invoke(main, args)


def assert_one_clear_line(result, code: int, needle: str) -> None:
    err = result.stderr
    assert result.exit_code == code, (result.exit_code, result.stdout, err)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in err and "internal error" not in err, err
    lines = err.splitlines()
    assert lines and lines[0].startswith("sm120patch: "), err
    assert all(x.startswith("  ") for x in lines[1:]), err  # what to do: `next:`, words
    assert needle in lines[0], (needle, err)


# ---- trees --------------------------------------------------------------------------------


def package_root(root: Path, layout: str, kind: str = "sglang") -> Path:
    """The directory holding the package (`python/` in an SGLang checkout)."""
    return root / "python" if (kind == "sglang" and layout == "git") else root


def edit(root: Path, layout: str, rel: str, data: bytes | None, kind: str = "sglang") -> Path:
    """Change a file of a tree (None: delete it); in a checkout, commit the change, so that
    the input is the tree's own content and not an uncommitted edit."""
    path = package_root(root, layout, kind) / rel
    if data is None:
        path.unlink()
    else:
        path.write_bytes(data)
    if layout == "git":
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", f"edit {rel}")
    return path


def text_of(root: Path, layout: str, rel: str, kind: str = "sglang") -> str:
    return (package_root(root, layout, kind) / rel).read_text()


def pair(tmp: Path, layout: str, sglang: str = "0.5.8") -> tuple[Path, Path]:
    return make_tree(tmp, "sglang", sglang, layout), make_tree(tmp, "flashinfer", "0.6.8", layout)


def apply_all(sg: Path, fi: Path) -> list[str]:
    return ["apply", "all", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check"]


def apply_moe(sg: Path) -> list[str]:
    return ["apply", "moe", "--sglang", str(sg), "--no-gpu-check"]


def state_dir(sg: Path) -> Path:
    d = sg / ".git" / "sm120patch" / "sglang"
    d.mkdir(parents=True, exist_ok=True)
    return d


def applied_manifest(tmp: Path) -> tuple[Path, Path, dict]:
    """A checkout with moe applied; returns it, its manifest path and the manifest."""
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    assert invoke(apply_moe(sg)).exit_code == 0
    path = sg / ".git" / "sm120patch" / "sglang" / "manifest.json"
    return sg, path, json.loads(path.read_text())


# ---- the corpus: one function per kind of input, returning what to run and expect ---------


def syntax_error(tmp: Path) -> Case:
    sg, fi = pair(tmp, "installed")
    edit(
        sg, "installed", COMMUNICATOR, text_of(sg, "installed", COMMUNICATOR).encode() + b"def (:\n"
    )
    return Case(apply_all(sg, fi), [sg, fi], 1, "does not parse")


def syntax_error_git(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    edit(sg, "git", SERVER_ARGS, text_of(sg, "git", SERVER_ARGS).encode() + b"if x\n")
    return Case(apply_moe(sg), [sg], 1, "does not parse")


def not_utf8(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    edit(
        sg,
        "installed",
        SERVER_ARGS,
        b"# caf\xe9 latin-1\n" + text_of(sg, "installed", SERVER_ARGS).encode(),
    )
    return Case(apply_moe(sg), [sg], 1, "is not UTF-8")


def missing_file(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    edit(sg, "installed", SERVER_ARGS, None)
    return Case(apply_moe(sg), [sg], 1, "none of its files exist")


def empty_file(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    edit(sg, "git", SERVER_ARGS, b"")
    return Case(apply_moe(sg), [sg], 1, "refused")


def file_is_a_directory(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    path = edit(sg, "installed", SERVER_ARGS, None)
    path.mkdir()
    return Case(apply_moe(sg), [sg], 1, "cannot read")


def read_only_directory(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    srt = sg / "sglang" / "srt"
    srt.chmod(0o555)
    if os.geteuid() != 0:
        return Case(apply_moe(sg), [sg], 1, "cannot write in")
    # root writes anywhere: make os.access answer as it does for anyone else.
    real = os.access

    def access(path, mode, *args, **kwargs):
        fd = kwargs.get("dir_fd")  # the tree's handle asks about a directory it holds open
        if fd is not None:
            path = Path(os.readlink(f"/proc/self/fd/{fd}")) / path
        if Path(path) == srt and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    return Case(apply_moe(sg), [sg], 1, "cannot write in", [lambda: ("os.access", access)])


def path_does_not_exist(tmp: Path) -> Case:
    return Case(apply_moe(tmp / "nowhere"), [], 2, "no such file or directory")


def path_is_a_file(tmp: Path) -> Case:
    (tmp / "a-file").write_text("x")
    return Case(apply_moe(tmp / "a-file"), [tmp], 2, "is a file")


def not_an_sglang_tree(tmp: Path) -> Case:
    (tmp / "empty" / "src").mkdir(parents=True)
    return Case(apply_moe(tmp / "empty"), [tmp / "empty"], 1, "not a SGLang tree")


def flashinfer_given_as_sglang(tmp: Path) -> Case:
    fi = make_tree(tmp, "flashinfer", "0.6.8", "installed")
    return Case(apply_moe(fi), [fi], 1, "not a SGLang tree")


def two_sglang_packages(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    shutil.copytree(sg / "python" / "sglang", sg / "sglang")
    git(sg, "add", "-A")
    git(sg, "commit", "-q", "-m", "a second copy")
    return Case(apply_moe(sg), [sg], 1, "two SGLang packages found")


def two_sglang_installs(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    other = sg / "sglang-0.5.9.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.9\n")
    return Case(apply_moe(sg), [sg], 1, "two SGLang installs")


def bare_repository(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    bare = tmp / "bare.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(sg), str(bare)], check=True)
    return Case(apply_moe(bare), [bare], 1, "bare git repository")


def checkout_configured_bare(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    git(sg, "config", "core.bare", "true")
    return Case(apply_moe(sg), [sg], 1, "bare git repository")


def broken_git_directory(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    (sg / ".git").mkdir()
    return Case(apply_moe(sg), [sg], 1, "not a usable git repository")


def owned_by_another_user(tmp: Path) -> Case:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the checkout to another user")
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    for path in [sg, *sg.rglob("*")]:
        os.lchown(path, 12345, 12345)
    return Case(apply_moe(sg), [sg], 1, "owned by another user")


def merge_in_progress(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    (sg / "NOTES").write_text("base\n")
    git(sg, "add", "-A")
    git(sg, "commit", "-q", "-m", "notes")
    git(sg, "checkout", "-q", "-b", "other")
    (sg / "NOTES").write_text("theirs\n")
    git(sg, "commit", "-q", "-am", "theirs")
    git(sg, "checkout", "-q", "main")
    (sg / "NOTES").write_text("ours\n")
    git(sg, "commit", "-q", "-am", "ours")
    subprocess.run(["git", "-C", str(sg), "merge", "-q", "other"], capture_output=True)
    assert (sg / ".git" / "MERGE_HEAD").exists()
    return Case(apply_moe(sg), [sg], 1, "in the middle of a merge")


def rebase_in_progress(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    (sg / "NOTES").write_text("base\n")
    git(sg, "add", "-A")
    git(sg, "commit", "-q", "-m", "notes")
    git(sg, "checkout", "-q", "-b", "other")
    (sg / "NOTES").write_text("theirs\n")
    git(sg, "commit", "-q", "-am", "theirs")
    git(sg, "checkout", "-q", "main")
    (sg / "NOTES").write_text("ours\n")
    git(sg, "commit", "-q", "-am", "ours")
    git(sg, "checkout", "-q", "other")
    subprocess.run(["git", "-C", str(sg), "rebase", "-q", "main"], capture_output=True)
    assert (sg / ".git" / "rebase-merge").exists() or (sg / ".git" / "rebase-apply").exists()
    return Case(apply_moe(sg), [sg], 1, "in the middle of a rebase")


def git_index_locked(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    (sg / ".git" / "index.lock").write_text("")
    return Case(apply_moe(sg), [sg], 1, "index.lock exists")


def no_commit_yet(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    shutil.rmtree(sg / ".git")
    git(sg, "init", "-q")
    git(sg, "add", "-A")
    return Case(apply_moe(sg), [sg], 1, "uncommitted changes")


def dirty_touched_file(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    path = sg / "python" / SERVER_ARGS
    path.write_text(path.read_text() + "# mine\n")
    return Case(apply_moe(sg), [sg], 1, "uncommitted changes")


def file_in_the_way_of_the_state_directory(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    (sg / ".git" / "sm120patch").write_text("not a directory\n")
    return Case(apply_moe(sg), [sg], 1, "in the way of sm120patch's state directory")


def link_in_the_way_of_the_state_directory(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    (sg / ".git" / "sm120patch").symlink_to(elsewhere)
    return Case(apply_moe(sg), [sg, elsewhere], 1, "in the way of sm120patch's state directory")


def file_in_the_way_of_the_installed_state_directory(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    (sg / ".sm120patch").write_text("x")  # beside the package, where its state lives
    return Case(apply_moe(sg), [sg], 1, "in the way of sm120patch's state directory")


def anchor_missing(tmp: Path) -> Case:
    sg, fi = pair(tmp, "git")
    text = text_of(sg, "git", COMMUNICATOR)
    text = text.replace("_is_sm100_supported = _is_cuda and is_sm100_supported()\n", "")
    edit(sg, "git", COMMUNICATOR, text.encode())
    return Case(apply_all(sg, fi), [sg, fi], 1, "refused")


def anchor_twice(tmp: Path) -> Case:
    sg, fi = pair(tmp, "installed")
    line = "_is_sm100_supported = _is_cuda and is_sm100_supported()\n"
    text = text_of(sg, "installed", COMMUNICATOR).replace(line, line + line)
    edit(sg, "installed", COMMUNICATOR, text.encode())
    return Case(apply_all(sg, fi), [sg, fi], 1, "2 assignments of _is_sm100_supported")


def anchor_changed_by_the_user(tmp: Path) -> Case:
    sg, fi = pair(tmp, "git")
    text = text_of(sg, "git", COMMUNICATOR).replace(
        "(_is_sm90_supported or _is_sm100_supported)", "(_is_sm90_supported or _is_hopper)"
    )
    edit(sg, "git", COMMUNICATOR, text.encode())
    return Case(apply_all(sg, fi), [sg, fi], 1, "sglang.fusion-gate: refused")


def flashinfer_anchor_changed(tmp: Path) -> Case:
    sg, fi = pair(tmp, "installed")
    text = text_of(fi, "installed", COMM, "flashinfer").replace("[9, 10]", "[9, 10, 11]", 1)
    edit(fi, "installed", COMM, text.encode(), "flashinfer")
    return Case(apply_all(sg, fi), [sg, fi], 1, "flashinfer.comm-arch: refused")


def unknown_profile(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    return Case(
        ["apply", "turbo", "--sglang", str(sg), "--no-gpu-check"],
        [sg],
        2,
        "unknown profile 'turbo'",
    )


def version_outside_the_pins(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.7", "installed")
    return Case(apply_moe(sg), [sg], 1, "outside the pins of profile moe")


def unparseable_version(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "banana", "installed")
    return Case(apply_moe(sg), [sg], 1, "is not a PEP 440 version")


def corrupt_manifest(tmp: Path) -> Case:
    sg, path, _ = applied_manifest(tmp)
    path.write_text('{"schema": 1, "prof')
    return Case(["revert", "moe", "--sglang", str(sg)], [sg], 1, "is corrupt or truncated")


def manifest_of_the_wrong_shape(tmp: Path) -> Case:
    sg, path, doc = applied_manifest(tmp)
    doc["files"] = "sglang/srt/server_args.py"
    path.write_text(json.dumps(doc))
    return Case(["revert", "moe", "--sglang", str(sg)], [sg], 1, "is corrupt (files is not a list)")


def manifest_from_a_newer_schema(tmp: Path) -> Case:
    sg, path, doc = applied_manifest(tmp)
    path.write_text(json.dumps({**doc, "schema": 99}))
    return Case(["revert", "moe", "--sglang", str(sg)], [sg], 1, "has schema 99")


def manifest_naming_a_path_outside(tmp: Path) -> Case:
    sg, path, doc = applied_manifest(tmp)
    doc["files"][0]["path"] = "../../outside.py"
    path.write_text(json.dumps(doc))
    return Case(["revert", "moe", "--sglang", str(sg), "--force"], [sg], 1, "outside its target")


def manifest_naming_an_absolute_path(tmp: Path) -> Case:
    sg, path, doc = applied_manifest(tmp)
    victim = tmp / "victim.py"
    victim.write_text("precious\n")
    doc["files"][0]["path"] = str(victim)
    path.write_text(json.dumps(doc))
    return Case(["status", "--sglang", str(sg)], [sg, tmp], 1, "outside its target")


def manifest_path_through_a_link_outside(tmp: Path) -> Case:
    sg, path, doc = applied_manifest(tmp)
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "server_args.py").write_text("precious\n")
    (sg / "python" / "sglang" / "escape").symlink_to(outside)
    doc["files"][0]["path"] = "python/sglang/escape/server_args.py"
    path.write_text(json.dumps(doc))
    return Case(
        ["revert", "moe", "--sglang", str(sg), "--force"], [sg, outside], 1,
        "follows no link inside a target",
    )  # fmt: skip


def manifest_naming_the_users_branch(tmp: Path) -> Case:
    sg, path, doc = applied_manifest(tmp)
    doc["git"]["patch_branch"] = "main"
    path.write_text(json.dumps(doc))
    return Case(["revert", "moe", "--sglang", str(sg)], [sg], 1, "is not an sm120patch/<profile>")


def manifest_naming_an_option(tmp: Path) -> Case:
    sg, path, doc = applied_manifest(tmp)
    doc["git"]["branch"] = "--orphan=x"
    path.write_text(json.dumps(doc))
    return Case(["revert", "moe", "--sglang", str(sg)], [sg], 1, "is not a branch name")


def manifest_with_pathspec_magic(tmp: Path) -> Case:
    sg, path, doc = applied_manifest(tmp)
    other = sg / "python" / COMMUNICATOR
    other.write_text(other.read_text() + "# the user's edit\n")
    doc["files"][0]["path"] = ":(top)"
    path.write_text(json.dumps(doc))
    # Not a file of the profile's patches: refused before git sees it.
    return Case(["revert", "moe", "--sglang", str(sg), "--force"], [sg], 1,
                "names :(top), which no patch of profile moe touches")  # fmt: skip


def manifest_naming_a_directory(tmp: Path) -> Case:
    sg, path, doc = applied_manifest(tmp)
    other = sg / "python" / COMMUNICATOR
    other.write_text(other.read_text() + "# the user's edit, which a reset of the package loses\n")
    doc["files"][0]["path"] = "python/sglang"
    path.write_text(json.dumps(doc))
    return Case(["revert", "moe", "--sglang", str(sg), "--force"], [sg], 1,
                "names python/sglang, which no patch of profile moe touches")  # fmt: skip


def pristine_copy_missing(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    assert invoke(apply_moe(sg)).exit_code == 0
    from sm120patch.engine import store
    from sm120patch.targets import finding

    t = finding.find("sglang", sg)
    shutil.rmtree(store.state_dir_for(t.root, t.layout, t.kind) / "pristine")
    return Case(["revert", "moe", "--sglang", str(sg)], [sg], 1, "cannot be restored")


def index_lock_while_the_journaling_run_lives(tmp: Path) -> Case:
    """A stale index.lock is removed by recover (tests/test_signals.py), but only once the run
    that wrote the journal is provably dead: here the journal names a live process (this
    one, pid and start time)."""
    from killing import KILL_ENV, run

    from sm120patch.targets import procscan

    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    assert run(*apply_moe(sg), env={KILL_ENV: "after-write"}).returncode == -9
    (sg / ".git" / "index.lock").write_text("")
    path = state_dir(sg) / "journal.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **procscan.identity()}))
    return Case(["recover", "--sglang", str(sg)], [sg], 75, "is still running")


def truncated_journal(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    (state_dir(sg) / "journal.json").write_text('{"schema": 1, "op": "app')
    return Case(["recover", "--sglang", str(sg)], [sg], 1, "journal.json is corrupt or truncated")


def journal_of_an_unknown_operation(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    (state_dir(sg) / "journal.json").write_text('{"schema": 1, "op": "explode"}')
    return Case(["recover", "--sglang", str(sg)], [sg], 1, "neither apply nor revert")


def truncated_trials(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    (state_dir(sg) / "trials.json").write_text('{"schema": 1, "trials": [{"verd')
    return Case(["status", "--sglang", str(sg)], [sg], 1, "trials.json is corrupt or truncated")


def full_disk_at_write(tmp: Path) -> Case:
    sg, fi = pair(tmp, "installed")

    def full(path, data):
        if path.name == "comm.py":
            raise OSError(errno.ENOSPC, "No space left on device")

    return Case(
        apply_all(sg, fi),
        [sg, fi],
        1,
        "No space left on device",
        [lambda p=p: p for p in write_patches(full)],
    )


def full_disk_at_the_journal(tmp: Path) -> Case:
    sg, fi = pair(tmp, "git")

    def full(path, data):
        if path.name in ("journal.json", "server_args.py") and "flashinfer" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")

    return Case(
        apply_all(sg, fi),
        [sg, fi],
        1,
        "No space left on device",
        [lambda p=p: p for p in write_patches(full)],
    )


def target_file_is_a_link_outside(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    outside = tmp / "outside.py"
    path = sg / SERVER_ARGS
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)
    # Refused at the first read: no target file is read through a link (safeio.read_regular).
    return Case(apply_moe(sg), [sg, tmp], 1, "is a symbolic link")


def target_file_is_a_link_inside(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "installed")
    path = sg / SERVER_ARGS
    real = path.with_name("server_args_real.py")
    path.rename(real)
    path.symlink_to(real.name)
    return Case(apply_moe(sg), [sg], 1, "symbolic link")


def lock_file_from_another_release(tmp: Path) -> Case:
    sg, fi = pair(tmp / "a", "git")
    lock = tmp / "sm120patch.lock"
    result = invoke(["pin", "all", "--sglang", str(sg), "--flashinfer", str(fi), "-o", str(lock)])
    assert result.exit_code == 0, result.stderr
    sg2, fi2 = pair(tmp / "b", "git", sglang="0.5.9")
    args = [
        "apply",
        "--locked",
        str(lock),
        "--sglang",
        str(sg2),
        "--flashinfer",
        str(fi2),
        "--no-gpu-check",
    ]
    return Case(args, [sg2, fi2], 1, "sglang version: lock has 0.5.8, found 0.5.9")


def revert_profile_and_all(tmp: Path) -> Case:
    sg = make_tree(tmp, "sglang", "0.5.8", "git")
    return Case(["revert", "moe", "--all", "--sglang", str(sg)], [sg], 2, "exactly one of")


def another_profile_applied(tmp: Path) -> Case:
    sg, fi = pair(tmp, "installed")
    assert invoke(apply_moe(sg)).exit_code == 0
    return Case(apply_all(sg, fi), [sg, fi], 1, "profile moe is applied")


CASES = [
    syntax_error,
    syntax_error_git,
    not_utf8,
    missing_file,
    empty_file,
    file_is_a_directory,
    read_only_directory,
    path_does_not_exist,
    path_is_a_file,
    not_an_sglang_tree,
    flashinfer_given_as_sglang,
    two_sglang_packages,
    two_sglang_installs,
    bare_repository,
    checkout_configured_bare,
    broken_git_directory,
    owned_by_another_user,
    merge_in_progress,
    rebase_in_progress,
    git_index_locked,
    no_commit_yet,
    dirty_touched_file,
    file_in_the_way_of_the_state_directory,
    link_in_the_way_of_the_state_directory,
    file_in_the_way_of_the_installed_state_directory,
    anchor_missing,
    anchor_twice,
    anchor_changed_by_the_user,
    flashinfer_anchor_changed,
    unknown_profile,
    version_outside_the_pins,
    unparseable_version,
    corrupt_manifest,
    manifest_of_the_wrong_shape,
    manifest_from_a_newer_schema,
    manifest_naming_a_path_outside,
    manifest_naming_an_absolute_path,
    manifest_path_through_a_link_outside,
    manifest_naming_the_users_branch,
    manifest_naming_an_option,
    manifest_with_pathspec_magic,
    manifest_naming_a_directory,
    pristine_copy_missing,
    index_lock_while_the_journaling_run_lives,
    truncated_journal,
    journal_of_an_unknown_operation,
    truncated_trials,
    full_disk_at_write,
    full_disk_at_the_journal,
    target_file_is_a_link_outside,
    target_file_is_a_link_inside,
    lock_file_from_another_release,
    revert_profile_and_all,
    another_profile_applied,
]


@pytest.mark.parametrize("make", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_clear_line_and_changes_nothing(make, tmp_path):
    case = make(tmp_path)
    before = [snapshot(r) for r in case.roots]
    journals_before = journals(case.roots)
    with pytest.MonkeyPatch.context() as mp:
        for patch in case.patches:
            target, replacement = patch()
            mp.setattr(target, replacement)
        result = invoke(case.args)
    assert_one_clear_line(result, case.code, case.needle)
    assert [snapshot(r) for r in case.roots] == before
    # Refused means nothing started: no new journal for `recover` to find.
    assert journals(case.roots) == journals_before


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 30


def test_no_traceback_from_a_real_process(tmp_path):
    """The same, through `python -m sm120patch` (what a user runs), for a few of them."""
    for make in (corrupt_manifest, syntax_error, path_does_not_exist, truncated_journal):
        case = make(tmp_path / make.__name__)
        before = [tree_hash(r) for r in case.roots]
        proc = subprocess.run(
            [os.sys.executable, "-m", "sm120patch", *case.args], capture_output=True, text=True
        )
        assert proc.returncode == case.code, proc.stderr
        assert "Traceback" not in proc.stderr
        lines = proc.stderr.splitlines()
        assert lines[0].startswith("sm120patch: "), proc.stderr
        assert all(x.startswith("  ") for x in lines[1:]), proc.stderr  # what to do
        assert [tree_hash(r) for r in case.roots] == before


# ---- inputs that must work ----------------------------------------------------------------


def roundtrip(args: list[str], revert: list[str], roots: list[Path]) -> None:
    before = [tree_hash(r) for r in roots]
    result = invoke(args)
    assert result.exit_code == 0, result.stderr
    assert [tree_hash(r) for r in roots] != before
    again = invoke(args)
    assert again.exit_code == 0 and "already applied" in again.stdout
    result = invoke(revert)
    assert result.exit_code == 0, result.stderr
    assert [tree_hash(r) for r in roots] == before


@pytest.mark.parametrize("layout", ["git", "installed"])
def test_crlf_line_endings_are_patched_and_kept(layout, tmp_path):
    sg, fi = pair(tmp_path, layout)
    for root, rel, kind in (
        (sg, COMMUNICATOR, "sglang"),
        (sg, SERVER_ARGS, "sglang"),
        (fi, COMM, "flashinfer"),
    ):
        text = text_of(root, layout, rel, kind)
        edit(root, layout, rel, text.replace("\n", "\r\n").encode(), kind)
    before = [tree_hash(r) for r in (sg, fi)]
    result = invoke(apply_all(sg, fi))
    assert result.exit_code == 0, result.stderr
    for root, rel, kind in (
        (sg, COMMUNICATOR, "sglang"),
        (sg, SERVER_ARGS, "sglang"),
        (fi, COMM, "flashinfer"),
    ):
        data = (package_root(root, layout, kind) / rel).read_bytes()
        assert b"sm120" in data or b"12]" in data
        assert data.count(b"\n") == data.count(b"\r\n"), rel  # every line ending kept CRLF
        compile(data, rel, "exec")
    revert = ["revert", "--all", "--sglang", str(sg), "--flashinfer", str(fi)]
    assert invoke(revert).exit_code == 0
    assert [tree_hash(r) for r in (sg, fi)] == before


def test_tab_indentation_is_patched_with_tabs(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")

    def tabs(line: str) -> str:
        stripped = line.lstrip(" ")
        return "\t" * ((len(line) - len(stripped)) // 4) + stripped

    text = text_of(sg, "installed", SERVER_ARGS)
    edit(sg, "installed", SERVER_ARGS, "\n".join(tabs(x) for x in text.split("\n")).encode())
    before = tree_hash(sg)
    result = invoke(apply_moe(sg))
    assert result.exit_code == 0, result.stderr
    patched = (sg / SERVER_ARGS).read_text()
    compile(patched, SERVER_ARGS, "exec")
    assert "flashinfer_cutlass" in patched
    assert not [x for x in patched.splitlines() if x.startswith(" ")]  # no space indentation
    assert invoke(["revert", "moe", "--sglang", str(sg)]).exit_code == 0
    assert tree_hash(sg) == before


def test_detached_head_applies_and_reverts_to_the_same_commit(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    head = git(sg, "rev-parse", "HEAD").strip()
    git(sg, "checkout", "-q", "--detach", head)
    roundtrip(apply_moe(sg), ["revert", "moe", "--sglang", str(sg)], [sg])
    assert git(sg, "rev-parse", "HEAD").strip() == head
    assert subprocess.run(["git", "-C", str(sg), "symbolic-ref", "-q", "HEAD"]).returncode == 1


def test_shallow_clone_applies_and_reverts(tmp_path):
    origin = make_tree(tmp_path / "origin", "sglang", "0.5.8", "git")
    (origin / "NOTES").write_text("second commit\n")
    git(origin, "add", "-A")
    git(origin, "commit", "-q", "-m", "second")
    sg = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{origin}", str(sg)], check=True)
    assert (sg / ".git" / "shallow").exists()
    roundtrip(apply_moe(sg), ["revert", "moe", "--sglang", str(sg)], [sg])


def test_read_only_file_is_patched_keeping_its_mode(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    path = sg / SERVER_ARGS
    path.chmod(0o444)
    roundtrip(apply_moe(sg), ["revert", "moe", "--sglang", str(sg)], [sg])
    assert invoke(apply_moe(sg)).exit_code == 0
    assert path.stat().st_mode & 0o777 == 0o444


@pytest.mark.parametrize("layout", ["git", "installed"])
def test_stale_lock_file_from_a_dead_process_is_no_obstacle(layout, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", layout)
    from sm120patch.engine import store
    from sm120patch.targets import finding

    t = finding.find("sglang", sg)
    d = store.state_dir_for(t.root, t.layout, t.kind)
    d.mkdir(parents=True, exist_ok=True)
    (d / "lock").write_text("12345\n")  # left by a run that died; no process holds it
    (d / "lock").chmod(0o600)  # as sm120patch makes it: one of another mode is refused
    roundtrip(apply_moe(sg), ["revert", "moe", "--sglang", str(sg)], [sg])
