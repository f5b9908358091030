"""Lock files (`pin`, `apply --locked`) and `export` on fixture trees."""

from __future__ import annotations

import re
import subprocess

import pytest
from click.testing import CliRunner
from trees import git, make_tree, tree_hash

from sm120patch.cli import main
from sm120patch.plan import lockfile


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def pin(tmp_path, sg, fi, profile="all"):
    lock = tmp_path / "sm120patch.lock"
    code, out, err = cli("pin", profile, "--sglang", str(sg), "--flashinfer", str(fi), "-o", str(lock))
    assert code == 0, err
    return lock


def test_lock_reproduces_on_a_fresh_checkout_and_on_an_installed_copy(tmp_path):
    sg = make_tree(tmp_path / "a", "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path / "a", "flashinfer", "0.6.8", "git")
    lock = pin(tmp_path, sg, fi)
    text = lock.read_text()
    assert 'profile = "all"' in text and 'sglang = "0.5.8"' in text and "sha256:" in text
    # Pinning changed nothing.
    assert git(sg, "status", "--porcelain") == ""

    for layout in ("git", "installed"):
        sg2 = make_tree(tmp_path / layout, "sglang", "0.5.8", layout)
        fi2 = make_tree(tmp_path / layout, "flashinfer", "0.6.8", layout)
        code, _, err = cli("apply", "--locked", str(lock), "--sglang", str(sg2),
                           "--flashinfer", str(fi2), "--no-gpu-check")
        assert code == 0, err
        # Same bytes as a direct apply on the first checkout.
        assert cli("apply", "all", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check")[0] == 0
        rel = "sglang/srt/server_args.py"
        ours = next(p for p in sg.rglob("server_args.py") if not {".git", ".sm120patch"} & set(p.parts))
        theirs = next(p for p in sg2.rglob("server_args.py") if not {".git", ".sm120patch"} & set(p.parts))
        assert ours.read_bytes() == theirs.read_bytes(), rel
        assert cli("revert", "--all", "--sglang", str(sg), "--flashinfer", str(fi))[0] == 0


def test_lock_refuses_another_release_and_changes_nothing(tmp_path):
    sg = make_tree(tmp_path / "a", "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path / "a", "flashinfer", "0.6.8", "git")
    lock = pin(tmp_path, sg, fi)
    sg2 = make_tree(tmp_path / "b", "sglang", "0.5.9", "git")
    fi2 = make_tree(tmp_path / "b", "flashinfer", "0.6.8", "git")
    before = [tree_hash(sg2), tree_hash(fi2)]
    code, _, err = cli("apply", "--locked", str(lock), "--sglang", str(sg2), "--flashinfer",
                       str(fi2), "--no-gpu-check")
    assert code == 1
    assert "sglang version: lock has 0.5.8, found 0.5.9" in err
    assert [tree_hash(sg2), tree_hash(fi2)] == before


def test_lock_refuses_a_changed_file(tmp_path):
    sg = make_tree(tmp_path / "a", "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path / "a", "flashinfer", "0.6.8", "git")
    lock = pin(tmp_path, sg, fi)
    sg2 = make_tree(tmp_path / "b", "sglang", "0.5.8", "installed")
    fi2 = make_tree(tmp_path / "b", "flashinfer", "0.6.8", "installed")
    comm = fi2 / "flashinfer/jit/comm.py"
    comm.write_text("# local build tweak\n" + comm.read_text())
    before = tree_hash(fi2)
    code, _, err = cli("apply", "--locked", str(lock), "--sglang", str(sg2), "--flashinfer",
                       str(fi2), "--no-gpu-check")
    assert code == 1
    assert "flashinfer flashinfer/jit/comm.py: file differs from the locked original" in err
    assert tree_hash(fi2) == before


def as_02x(lock_text: str) -> str:
    """A lock as sm120patch 0.2.x wrote it: schema 1, each patch with the digest of its code
    and its source key (what this release no longer writes or compares)."""
    text = lock_text.replace(f"schema = {lockfile.SCHEMA}\n", "schema = 1\n", 1)
    text = re.sub(r'tool_version = "[^"]*"', 'tool_version = "0.2.1"', text, count=1)
    text = re.sub(r'(\[\[patches\]\]\nid = "[^"]+"\n)', r'\1digest = "sha256:%s"\n' % ("0" * 64), text)
    return re.sub(r'(\[\[patches\]\]\nid = [^\n]+\ndigest = [^\n]+\npack = "[^"]+"\n)',
                  r'\1source = "sha256:%s"\n' % ("1" * 64), text)  # fmt: skip


def test_a_lock_written_by_02x_still_applies(tmp_path):
    """A 0.2.x lock pins the same bytes (files and steps): it applies, `ensure --locked` holds
    to it, and it reads back to the bytes it was written as; the digests of the patch code it
    carries are kept, never compared (here they are zeros, which no code has)."""
    sg = make_tree(tmp_path / "a", "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path / "a", "flashinfer", "0.6.8", "git")  # moe refuses <0.6.7
    lock = pin(tmp_path, sg, fi, profile="moe")
    new = lock.read_text()
    assert "digest" not in new.split("[[packs]]")[0] and f"schema = {lockfile.SCHEMA}" in new
    lock.write_text(as_02x(new))
    assert 'digest = "sha256:' + "0" * 64 in lock.read_text() and "source = " in lock.read_text()
    old = lockfile.read(lock)
    assert old.schema == 1 and old.to_toml() == lock.read_text()
    code, _, err = cli("apply", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    code, out, err = cli("ensure", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")
    assert code == 0 and "already applied" in out, out + err


def test_a_lock_written_by_02x_whose_bytes_differ_is_refused_saying_to_pin_again(tmp_path):
    """Where a 0.2.x patch wrote other bytes than this release's (the lock's after-hashes),
    the lock is refused in one line (and its hint), nothing changed, saying to pin again."""
    sg = make_tree(tmp_path / "a", "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path / "a", "flashinfer", "0.6.8", "installed")
    lock = pin(tmp_path, sg, fi, profile="moe")
    first = lockfile.read(lock).files[0].after
    lock.write_text(as_02x(lock.read_text()).replace(f'after = "{first}"', f'after = "{"e" * 64}"'))
    before = tree_hash(sg)
    code, _, err = cli("apply", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")
    assert code == 1, err
    line, *what_to_do = _refusal(err)
    hint = "\n".join(what_to_do)
    assert "patched text would differ from the locked result" in line, err
    assert "written by sm120patch 0.2.1: pin again" in hint and "sm120patch pin moe" in hint, err
    assert tree_hash(sg) == before


def test_corrupt_lock_is_one_line(tmp_path):
    lock = tmp_path / "bad.lock"
    lock.write_text("schema = 1\nprofile = ")
    code, _, err = cli("apply", "--locked", str(lock), "--no-gpu-check")
    assert code == 1
    assert f"lock file {lock} is not TOML" in err and "Traceback" not in err


def _refusal(err: str) -> list[str]:
    lines = err.strip("\n").split("\n")
    assert len(lines) >= 2 and all(x.startswith("  ") for x in lines[1:]), err  # what to do
    assert lines[0].startswith("sm120patch: ") and "Traceback" not in err, err
    return lines


def test_a_lock_reads_and_writes_back_byte_for_byte(tmp_path):
    """What `pin` wrote is what reading it and writing it again gives: its digest (recorded in
    manifests) and a reviewer's diff of two locks hold across versions of sm120patch."""
    sg = make_tree(tmp_path / "a", "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path / "a", "flashinfer", "0.6.8", "installed")
    path = pin(tmp_path, sg, fi)
    lock = lockfile.read(path)
    assert lock.files and lock.steps
    assert all(isinstance(f, lockfile.LockedFile) for f in lock.files)
    assert all(isinstance(s, lockfile.LockedStep) for s in lock.steps)
    assert lock.to_toml().encode("utf-8") == path.read_bytes()


# A lock in the format sm120patch has written since locks had steps: it must go on reading,
# and write back to the same bytes.
OLD_LOCK = f"""\
# sm120patch lock file: `sm120patch apply --locked <this file>` reproduces exactly
# this patch set, or refuses (changing nothing) when anything below differs.
schema = 1
tool_version = "0.1.0"
profile = "all"

[versions]
sglang = "0.5.8"

[[patches]]
id = "sglang.sm120-flag"
digest = "sha256:{"a" * 64}"
pack = "built-in"
source = "{"b" * 64}"

[[files]]
target = "sglang"
path = "sglang/srt/server_args.py"
before = "{"c" * 64}"
after = "{"d" * 64}"

[[steps]]
target = "sglang"
path = "sglang/srt/server_args.py"
patch = "sglang.sm120-flag"
after = "{"d" * 64}"
diff = "--- a/sglang/srt/server_args.py\\n+++ b/sglang/srt/server_args.py\\n"
"""


def test_an_old_lock_reads_into_records_and_writes_back_the_same_bytes(tmp_path):
    path = tmp_path / "old.lock"
    path.write_text(OLD_LOCK)
    lock = lockfile.read(path)
    assert lock.files == [lockfile.LockedFile("sglang", "sglang/srt/server_args.py",
                                              "c" * 64, "d" * 64)]  # fmt: skip
    assert lock.steps[0].patch == "sglang.sm120-flag"
    assert lock.steps[0].diff.endswith("server_args.py\n")
    assert lock.to_toml() == OLD_LOCK


@pytest.mark.parametrize(("edit", "says"), [
    (lambda t: t.replace('after = "' + "d" * 64 + '"\ndiff', "after = 7\ndiff"),
     "[[steps]] entry 1: `after` is not a string"),
    (lambda t: t.replace('patch = "sglang.sm120-flag"', 'patch = ["sglang.sm120-flag"]'),
     "[[steps]] entry 1: `patch` is not a string"),
    (lambda t: t.replace("diff = ", "difff = "), "[[steps]] entry 1 has no `diff`"),
    (lambda t: t.replace('before = "' + "c" * 64, 'before = "' + "c" * 63),
     "[[files]] entry 1: `before` is not a sha256"),
    (lambda t: t.replace("[[steps]]", "[steps]"), "`steps` is not an array of tables"),
    (lambda t: t.replace('profile = "all"\n', 'profile = "all"\nfiles = [1]\n')
     .replace("[[files]]", "[x]"), "[[files]] entry 1 is not a table"),
    (lambda t: t.replace("schema = 1\n", ""), "it has no `schema`"),
    (lambda t: t.replace("[versions]", "[versionz]"), "it has no `versions`"),
])  # fmt: skip
def test_a_lock_with_a_wrongly_typed_entry_is_one_line(tmp_path, edit, says):
    path = tmp_path / "bad.lock"
    path.write_text(edit(OLD_LOCK))
    code, _, err = cli("apply", "--locked", str(path), "--no-gpu-check")
    assert code == 1
    first = _refusal(err)[0]
    assert f"lock file {path} is not a lock sm120patch pin wrote: {says}" in first, err
    assert "next: sm120patch pin all -o" in err, err


def test_export_applies_with_git_am(tmp_path):
    sg = make_tree(tmp_path / "a", "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path / "a", "flashinfer", "0.6.8", "git")
    out = tmp_path / "patches"
    code, stdout, err = cli("export", "all", "--sglang", str(sg), "--flashinfer", str(fi), "-o", str(out))
    assert code == 0, err
    sg_patches = sorted((out / "sglang").glob("*.patch"))
    assert [p.name.split("-", 1)[1] for p in sg_patches] == [
        "sglang-sm120-flag.patch", "sglang-fusion-gate.patch",
        "sglang-fusion-autoenable.patch", "sglang-moe-backend.patch",
        "sglang-moe-backend-qwen3.patch",
    ]
    assert len(list((out / "flashinfer").glob("*.patch"))) == 1
    # On another checkout of the same release, `git am` takes them, trailers and all.
    for kind, root in (("sglang", make_tree(tmp_path / "b", "sglang", "0.5.8", "git")),
                       ("flashinfer", make_tree(tmp_path / "b", "flashinfer", "0.6.8", "git"))):
        files = sorted(str(p) for p in (out / kind).glob("*.patch"))
        proc = subprocess.run(["git", "-C", str(root), "am", *files], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        log = git(root, "log", "--format=%B", "-n", str(len(files)))
        assert log.count("Sm120patch-Profile: all") == len(files)
    # Same result as sm120patch's own apply.
    assert cli("apply", "all", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check")[0] == 0
    other = tmp_path / "b" / "sglang-git"
    for rel in ("python/sglang/srt/server_args.py", "python/sglang/srt/layers/communicator.py"):
        assert (sg / rel).read_bytes() == (other / rel).read_bytes()
