"""The engine on real releases: SGLang 0.5.8 + FlashInfer 0.6.8 as git checkouts
and as packages pip installed into a virtual environment. apply all, status, revert --all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from click.testing import CliRunner

from sm120patch.cli import main
from sm120patch.maintain import dists as distfiles
from sm120patch.maintain import releases, trees

pytestmark = pytest.mark.real

# FlashInfer 0.6.8, not the 0.6.1 SGLang 0.5.8 pins: `all` refuses a FlashInfer before 0.6.7.
SGLANG, FLASHINFER = "0.5.8", "0.6.8"
# What `all` applies on these two releases: the fusion-backend site only exists from 0.5.14.
SGLANG_PATCHES = ["sglang.sm120-flag", "sglang.fusion-gate", "sglang.fusion-autoenable",
                  "sglang.moe-backend", "sglang.moe-backend-qwen3"]


@pytest.fixture(scope="module")
def dists():
    if not releases.index_reachable() and (
        distfiles.cached("sglang", SGLANG) is None or distfiles.cached("flashinfer", FLASHINFER) is None
    ):
        pytest.skip(f"the index ({releases.index_sources()}) is unreachable and the releases are not cached")
    return distfiles.fetch("sglang", SGLANG), distfiles.fetch("flashinfer", FLASHINFER)


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(root).parts
            and "__pycache__" not in p.parts}


def checkout(tmp: Path, kind: str, version: str) -> Path:
    """A git repository laid out like the project's own (SGLang under python/)."""
    tree = trees.tree(kind, version)
    root = tmp / f"{kind}-checkout"
    parent = root / "python" if kind == "sglang" else root
    shutil.copytree(tree / kind, parent / kind)
    git(root.parent, "init", "-q", "-b", "main", str(root))
    git(root, "add", "-A")
    git(root, "-c", "user.name=T", "-c", "user.email=t@example.com", "commit", "-q", "-m", "v")
    return root


def test_git_checkouts(tmp_path, dists):
    sg = checkout(tmp_path, "sglang", SGLANG)
    fi = checkout(tmp_path, "flashinfer", FLASHINFER)
    # A checkout has no generated version file: say which release it is the way a dev install
    # would, through a version.py.
    for root, kind, version in ((sg / "python", "sglang", SGLANG), (fi, "flashinfer", FLASHINFER)):
        (root / kind / "version.py").write_text(f'__version__ = "{version}"\n')
        git(root if kind == "flashinfer" else sg, "add", "-A")
        git(root if kind == "flashinfer" else sg, "-c", "user.name=T", "-c",
            "user.email=t@example.com", "commit", "-q", "-m", "version")
    before = {r: (snapshot(r), git(r, "rev-parse", "HEAD")) for r in (sg, fi)}
    where = ["--sglang", str(sg), "--flashinfer", str(fi)]

    code, out, err = cli("apply", "all", "--dry-run", *where)
    assert code == 0, err
    chunks = ["diff --git" + c for c in out.split("diff --git")[1:]]
    for root in (sg, fi):
        mine = "".join(c for c in chunks if (root / c.split()[2][2:]).exists())
        proc = subprocess.run(["git", "-C", str(root), "apply", "--check", "-"], input=mine,
                              text=True, capture_output=True)
        assert proc.returncode == 0, proc.stderr

    code, _, err = cli("apply", "all", *where, "--no-gpu-check")
    assert code == 0, err
    log = git(sg, "log", "--format=%B%x00", "main..sm120patch/all").split("\0")
    trailers = [line.split(": ", 1)[1] for m in log for line in m.splitlines()
                if line.startswith("Sm120patch-Patch:")]
    assert trailers == list(reversed(SGLANG_PATCHES))
    assert git(fi, "log", "--format=%B", "main..sm120patch/all").count(
        "Sm120patch-Patch: flashinfer.comm-arch") == 1
    code, out, _ = cli("status", *where, "--json")
    doc = json.loads(out)
    assert {f["state"] for t in doc["targets"] for f in t["files"]} == {"patched"}
    assert [t["branch"] for t in doc["targets"]] == ["sm120patch/all"] * 2

    code, _, err = cli("revert", "--all", *where)
    assert code == 0, err
    for root, (files, head) in before.items():
        assert git(root, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
        assert git(root, "rev-parse", "HEAD") == head
        assert "sm120patch/all" not in git(root, "branch", "--list")
        assert snapshot(root) == files


def test_pip_installed_into_a_venv(tmp_path, dists):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The pip of this interpreter installs into the venv (the wheels come from the cache).
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", "--no-compile", "--disable-pip-version-check", *map(str, dists)],
                   check=True, capture_output=True)
    before = {k: snapshot(site / k) for k in ("sglang", "flashinfer")}
    where = ["--sglang", str(site), "--flashinfer", str(site)]
    code, out, err = cli("apply", "all", *where, "--dry-run")
    assert code == 0, err
    assert "+_is_sm120_supported = _is_cuda and is_sm120_supported()" in out
    code, _, err = cli("apply", "all", *where, "--no-gpu-check")
    assert code == 0, err
    doc = json.loads(cli("status", *where, "--json")[1])
    assert [t["layout"] for t in doc["targets"]] == ["installed"] * 2
    assert {f["state"] for t in doc["targets"] for f in t["files"]} == {"patched"}
    assert before["sglang"] != snapshot(site / "sglang")
    code, _, err = cli("revert", "--all", *where)
    assert code == 0, err
    after = {k: snapshot(site / k) for k in before}
    changed = [f"{k}/{f}" for k in before for f in set(before[k]) | set(after[k])
               if before[k].get(f) != after[k].get(f)]
    assert changed == []


def test_lock_from_one_tree_applies_on_another_and_refuses_another_release(tmp_path, dists):
    lock = tmp_path / "sm120patch.lock"
    sg_tree, fi_tree = trees.tree("sglang", SGLANG), trees.tree("flashinfer", FLASHINFER)
    code, _, err = cli("pin", "all", "--sglang", str(sg_tree), "--flashinfer", str(fi_tree),
                       "-o", str(lock))
    assert code == 0, err
    sg = checkout(tmp_path, "sglang", SGLANG)
    fi = checkout(tmp_path, "flashinfer", FLASHINFER)
    for root, kind, version in ((sg / "python", "sglang", SGLANG), (fi, "flashinfer", FLASHINFER)):
        (root / kind / "version.py").write_text(f'__version__ = "{version}"\n')
    git(sg, "add", "-A")
    git(sg, "-c", "user.name=T", "-c", "user.email=t@example.com", "commit", "-q", "-m", "v")
    git(fi, "add", "-A")
    git(fi, "-c", "user.name=T", "-c", "user.email=t@example.com", "commit", "-q", "-m", "v")
    code, _, err = cli("apply", "--locked", str(lock), "--sglang", str(sg), "--flashinfer",
                       str(fi), "--no-gpu-check")
    assert code == 0, err
    assert cli("revert", "--all", "--sglang", str(sg), "--flashinfer", str(fi))[0] == 0

    other = trees.tree("sglang", "0.5.9")
    before = snapshot(other)
    code, _, err = cli("apply", "--locked", str(lock), "--sglang", str(other), "--flashinfer",
                       str(fi_tree), "--no-gpu-check")
    assert code == 1
    assert "sglang version: lock has 0.5.8, found 0.5.9" in err
    assert snapshot(other) == before


def test_pip_reinstall_and_upgrade_are_seen_from_the_bytes(tmp_path, dists):
    """States from the bytes on a real venv: `pip install --force-reinstall` of the same release makes the
    patch gone (apply re-applies, `--locked` does not pass over pristine files); an upgrade
    makes it replaced, and `revert --force` never writes 0.5.8's bytes into 0.5.9."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())

    def pip(*args: str) -> None:
        subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "--no-deps", "--no-compile", "--disable-pip-version-check", *args],
                       check=True, capture_output=True)

    pip(*map(str, dists))
    where = ["--sglang", str(site), "--flashinfer", str(site)]
    lock = tmp_path / "all.lock"
    assert cli("pin", "all", *where, "-o", str(lock))[0] == 0
    assert cli("apply", "--locked", str(lock), *where, "--no-gpu-check")[0] == 0
    server_args = site / "sglang/srt/server_args.py"
    patched = server_args.read_bytes()
    pip("--force-reinstall", str(dists[0]))
    assert server_args.read_bytes() != patched
    states = {t["kind"]: t["state"] for t in json.loads(cli("status", *where, "--json")[1])["targets"]}
    assert states == {"sglang": "gone", "flashinfer": "applied"}
    code, out, err = cli("apply", "--locked", str(lock), *where, "--no-gpu-check")
    assert code == 0, err
    assert server_args.read_bytes() == patched  # the lock's bytes, proven after writing

    newer = distfiles.fetch("sglang", "0.5.9")
    pip(str(newer))
    upgraded = server_args.read_bytes()
    doc = {t["kind"]: t for t in json.loads(cli("status", *where, "--json")[1])["targets"]}
    assert doc["sglang"]["state"] == "replaced"
    assert "SGLang was 0.5.8 when profile all was applied, 0.5.9 is installed now" in doc["sglang"]["message"]
    code, out, err = cli("revert", "all", *where, "--force")
    assert code == 0, err
    assert server_args.read_bytes() == upgraded
