"""A patch pack written by `sm120patch new-patch`, applied and reverted through the CLI on a git
checkout of a real FlashInfer release; `list`, `show` and `pin` say where its patch comes from."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_engine_real import cli, git

from sm120patch.config import Config
from sm120patch.maintain import dists, releases, trees
from sm120patch.plan import lockfile, registry

pytestmark = pytest.mark.real

VERSION = "0.6.15"  # gen_trtllm_mnnvl_comm_module passes supported_major_versions=[9, 10]
SITE = "flashinfer/jit/comm.py"


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    if dists.cached("flashinfer", VERSION) is None and not releases.pypi_reachable():
        pytest.skip(f"PyPI is unreachable and FlashInfer {VERSION} is not cached")
    root = tmp_path / "flashinfer-checkout"
    shutil.copytree(trees.tree("flashinfer", VERSION) / "flashinfer", root / "flashinfer")
    (root / "flashinfer" / "version.py").write_text(f'__version__ = "{VERSION}"\n')
    git(tmp_path, "init", "-q", "-b", "main", str(root))
    git(root, "add", "-A")
    git(root, "-c", "user.name=T", "-c", "user.email=t@example.com", "commit", "-q", "-m", "v")
    return root


def test_new_patch_pack_applies_and_reverts_on_a_real_release(tmp_path: Path, checkout: Path):
    pack = tmp_path / "pack"
    code, out, err = cli(
        "new-patch",
        "flashinfer.mnnvl-arch",
        "--target",
        "flashinfer",
        "--file",
        SITE,
        "--function",
        "gen_trtllm_mnnvl_comm_module",
        "--pins",
        f"=={VERSION}",
        "--keyword",
        "supported_major_versions",
        "--expect",
        "9,10",
        "--add",
        "12",
        "--dir",
        str(pack),
    )
    assert code == 0, err
    assert sorted(p.name for p in pack.iterdir()) == [
        "flashinfer_mnnvl_arch.py",
        "profiles.toml",
        "test_flashinfer_mnnvl_arch.py",
    ]
    # The test new-patch wrote passes as written.
    run = subprocess.run(
        ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pack)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr

    with_pack = ["--patches", str(pack)]
    code, out, err = cli(*with_pack, "list", "--json")
    assert code == 0, err
    doc = json.loads(out)
    sources = {p["id"]: p["source"] for p in doc["patches"]}
    assert sources["flashinfer.mnnvl-arch"] == f"directory {pack.resolve()}"
    assert sources["flashinfer.comm-arch"] == "built-in"
    code, out, err = cli(*with_pack, "show", "mnnvl-arch")
    # show wraps at 100 columns: the words, whatever the line breaks between them
    assert f"flashinfer.mnnvl-arch (flashinfer, directory {pack.resolve()})" in " ".join(
        out.split()
    )
    # Without the pack the profile does not exist.
    code, _, err = cli("show", "mnnvl-arch")
    assert code == 2 and "unknown profile 'mnnvl-arch'" in err

    site = checkout / SITE
    before = site.read_bytes()
    where = ["--flashinfer", str(checkout)]
    code, out, err = cli(*with_pack, "apply", "mnnvl-arch", "--no-gpu-check", *where)
    assert code == 0, err
    after = site.read_text(encoding="utf-8")
    assert after.count("supported_major_versions=[9, 10, 12]") == 1
    changed = [
        line
        for line in git(checkout, "diff", "main", "--", SITE).splitlines()
        if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
    ]
    assert changed == [
        "-        supported_major_versions=[9, 10]",
        "+        supported_major_versions=[9, 10, 12]",
    ]

    code, out, err = cli(*with_pack, "revert", "mnnvl-arch", *where)
    assert code == 0, err
    assert site.read_bytes() == before
    assert git(checkout, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"

    lock = tmp_path / "pack.lock"
    code, _, err = cli(*with_pack, "pin", "mnnvl-arch", *where, "-o", str(lock))
    assert code == 0, err
    written = lockfile.read(lock)
    assert written.pack_of == {"flashinfer.mnnvl-arch": f"directory {pack.resolve()}"}
    # profile and patch both come from the pack; its digest is recorded
    assert written.packs == {
        f"directory {pack.resolve()}": registry.digest_dir(str(pack.resolve()))
    }
    assert lockfile.differences(written, _plan(pack, checkout)) == []


def _plan(pack: Path, checkout: Path):
    from sm120patch.plan.planner import plan
    from sm120patch.targets.resolved import Resolved

    return plan("mnnvl-arch", Resolved({"flashinfer": checkout}, Config((str(pack),))))
