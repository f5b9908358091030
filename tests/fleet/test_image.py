"""The image recipe (examples/Containerfile), the systemd drop-in and the Kubernetes manifest.

The Containerfile's steps ran in a fresh venv (the session's `fleet`): here we check what they
left against the lock, then run each start-up guard's own command against that "image".
"""

from __future__ import annotations

import configparser
import hashlib
import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import FLASHINFER, IMAGE_PROFILE, SGLANG, Fleet
from fleetkit import EXAMPLES, snapshot

from sm120patch.plan import lockfile

pytestmark = [pytest.mark.real, pytest.mark.fleet]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_image_build_applies_exactly_the_lock(fleet: Fleet):
    lock = lockfile.read(fleet.lock)
    assert lock.profile == IMAGE_PROFILE
    assert lock.versions == {"sglang": SGLANG, "flashinfer": FLASHINFER}
    # sm120patch came from this checkout's wheel, not an index: pip records a wheel file URL.
    direct = next(fleet.site_packages.glob("sm120patch-*.dist-info")) / "direct_url.json"
    assert direct.is_file() and "/wheels/sm120patch-" in direct.read_text()
    # Every file the lock names now has the locked after-bytes, in the venv's own packages.
    assert len(lock.files) == 3
    for f in lock.files:
        path = fleet.site_packages / f.path
        assert _sha(path) == f.after, f.path
    # The lock was copied to the image's lock path and the image's sm120patch records it.
    locked = Path(fleet.image.env["SM120PATCH_LOCK"])
    assert locked.read_bytes() == fleet.lock.read_bytes()
    status = fleet.tool("status", "--json", state=fleet.image_state, check=True)
    found = {t["kind"]: t for t in json.loads(status.stdout)["targets"]}
    assert {k: t["profile"] for k, t in found.items()} == {
        "sglang": IMAGE_PROFILE,
        "flashinfer": IMAGE_PROFILE,
    }
    assert all(f["state"] == "patched" for t in found.values() for f in t["files"])
    assert {Path(t["root"]).resolve() for t in found.values()} == {fleet.site_packages.resolve()}


def test_image_build_step_refuses_a_lock_for_other_releases(fleet: Fleet, site: Path, tmp_path):
    """The build's apply step, on packages other than the lock's, fails and changes nothing."""
    other = tmp_path / "other.lock"
    other.write_text(fleet.lock.read_text().replace(f'sglang = "{SGLANG}"', 'sglang = "0.5.9"'))
    step = next(s for s in fleet.image.steps if "apply --locked" in s)
    before = snapshot(site)
    proc = subprocess.run(
        ["/bin/sh", "-c", step],
        # The step patches the interpreter's own packages: here a pristine copy, found first.
        env={**fleet.image_env(), "SM120PATCH_LOCK": str(other), "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    # Exit 1, not the venv's already-applied "nothing to do": it planned on the copy.
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "sglang version: lock has 0.5.9, found 0.5.8" in proc.stderr
    # What to do, on its own line (prose: no command pastes here, the lock is made elsewhere).
    assert "\n  nothing was changed; use the releases the lock was made on" in proc.stderr
    assert snapshot(site) == before


def test_image_entrypoint_runs_ensure_then_the_command(fleet: Fleet):
    assert "ensure --locked" in " ".join(fleet.image.entrypoint)
    proc = subprocess.run(
        [*fleet.image.entrypoint, "python", "-c", "print('serving')"],
        env=fleet.image_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "serving"


def test_image_entrypoint_stops_a_drifted_image(fleet: Fleet, tmp_path):
    lock = lockfile.read(fleet.lock)
    path = fleet.site_packages / lock.files[0].path
    original = path.read_bytes()
    try:
        path.write_bytes(original + b"# edited in the image\n")
        proc = subprocess.run(
            [*fleet.image.entrypoint, "python", "-c", "print('serving')"],
            env=fleet.image_env(),
            capture_output=True,
            text=True,
        )
    finally:
        path.write_bytes(original)
    assert proc.returncode == 1
    assert "serving" not in proc.stdout
    assert "next:" in proc.stdout + proc.stderr


def _drop_in() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(EXAMPLES / "systemd" / "sglang.service.d" / "sm120patch.conf")
    return parser


def test_systemd_drop_in_guards_the_start_with_the_image_lock():
    service = _drop_in()["Service"]
    argv = shlex.split(service["ExecStartPre"])
    assert argv[0].endswith("/sm120patch") and argv[1:3] == ["ensure", "--locked"]
    # The lock it checks is the one the rollout playbook copies.
    rollout = yaml.safe_load((EXAMPLES / "ansible" / "rollout.yml").read_text())
    assert argv[3] == rollout[0]["vars"]["sm120patch_lock"]


def test_systemd_exec_start_pre_passes_on_the_locked_tree(fleet: Fleet):
    argv = shlex.split(_drop_in()["Service"]["ExecStartPre"])
    # The unit's binary and lock are this "image"'s; no SM120 GPU here.
    argv = [str(fleet.python.parent / "sm120patch"), *argv[1:3], str(fleet.lock), "--no-gpu-check"]
    proc = subprocess.run(argv, env=fleet.image_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _deployment() -> dict:
    docs = list(yaml.safe_load_all((EXAMPLES / "kubernetes" / "sglang.yaml").read_text()))
    return next(d for d in docs if d and d.get("kind") == "Deployment")


def test_kubernetes_init_container_ensures_the_image_lock():
    pod = _deployment()["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    server = next(c for c in pod["containers"] if c["name"] == "sglang")
    assert init["image"] == server["image"]
    assert init["command"][:3] == ["sm120patch", "ensure", "--locked"]
    # The lock path is the image's (the Containerfile's ENV with its default PREFIX).
    assert init["command"][3] == "/opt/sm120patch/sm120patch.lock"
    # The server keeps the image's entrypoint (ensure, then exec): it only passes arguments.
    assert "command" not in server and server["args"][:3] == [
        "python",
        "-m",
        "sglang.launch_server",
    ]


def _init_container(fleet: Fleet, *extra: str) -> subprocess.CompletedProcess:
    """The init container's command, with this "image"'s binary and lock (no GPU here)."""
    init = _deployment()["spec"]["template"]["spec"]["initContainers"][0]
    argv = [
        str(fleet.python.parent / "sm120patch"),
        *init["command"][1:3],
        str(fleet.lock),
        *init["command"][4:],
        "--no-gpu-check",
        *extra,
    ]
    return subprocess.run(argv, env=fleet.image_env(), capture_output=True, text=True)


def test_kubernetes_init_container_command_passes_on_the_image(fleet: Fleet):
    proc = _init_container(fleet)
    assert proc.returncode == 0, proc.stderr


def test_kubernetes_init_container_only_verifies(fleet: Fleet, site: Path):
    """On packages that are not the locked tree the init container's command exits 1 (the
    pod's Init:Error) and writes nothing: it never makes its own copy right and passes."""
    assert "--no-apply" in _deployment()["spec"]["template"]["spec"]["initContainers"][0]["command"]
    before = snapshot(site, with_state=True)
    proc = _init_container(fleet, "--sglang", str(site), "--flashinfer", str(site))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert snapshot(site, with_state=True) == before
