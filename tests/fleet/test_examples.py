"""The examples as they are written: examples/ansible/rollout.yml through real ansible-playbook
on localhost (a node without the lock and without the drop-in directory), the Containerfile's
build context and wheel step, the collection's README.

systemd is not running here: a stand-in `systemctl` first on PATH answers the handlers' queries
and logs what they asked, so the test sees which reloads and restarts a run would do.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import Fleet
from fleetkit import (
    COLLECTION,
    EXAMPLES,
    LEFTOVERS,
    ROOT,
    ansible_playbook,
    build_context,
    checkout_files,
    dockerignored,
    run_containerfile,
    snapshot,
)

from sm120patch import __version__
from sm120patch.plan import lockfile

pytestmark = pytest.mark.fleet
real = pytest.mark.real

ROLLOUT = EXAMPLES / "ansible" / "rollout.yml"

FAKE_SYSTEMCTL = """#!/bin/sh
# systemd stand-in for the tests: log the call, answer `show UNIT` as for a running unit.
echo "$*" >> {log}
if [ "$1" = show ]; then
  printf 'Id=%s\\nLoadState=loaded\\nActiveState=active\\nSubState=running\\n' "$2"
  printf 'UnitFileState=enabled\\n'
fi
exit 0
"""


class Node:
    """A stand-in GPU node on localhost: its /etc under tmp, its packages the `site` copy."""

    def __init__(self, fleet: Fleet, site: Path, tmp: Path) -> None:
        self.fleet, self.site, self.tmp = fleet, site, tmp
        self.trees = {"sglang": site, "flashinfer": site}  # a checkout's node sets its roots
        self.etc = tmp / "etc"  # a stock node's /etc: no lock, no drop-in directory
        self.etc.mkdir()
        self.systemctl_log = tmp / "systemctl.log"
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        fake = bin_dir / "systemctl"
        fake.write_text(FAKE_SYSTEMCTL.format(log=self.systemctl_log))
        fake.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    @property
    def lock(self) -> Path:
        return self.etc / "sm120patch.lock"

    @property
    def drop_in(self) -> Path:
        return self.etc / "systemd" / "system" / "sglang.service.d" / "sm120patch.conf"

    def systemctl_calls(self) -> list[str]:
        if not self.systemctl_log.exists():
            return []
        return self.systemctl_log.read_text().splitlines()

    def rollout(self, *flags: str) -> subprocess.CompletedProcess:
        extra = {
            "target_hosts": "localhost",
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "ansible_become": False,  # root already here, and no sudo to become with
            "sm120patch_lock_src": str(self.fleet.lock),
            "sm120patch_lock": str(self.lock),
            "systemd_unit_dir": str(self.etc / "systemd" / "system"),
            "sglang_python": str(self.fleet.python),
            "sglang_tree": str(self.trees["sglang"]),
            "flashinfer_tree": str(self.trees["flashinfer"]),
            "sm120patch_gpu_check": False,  # no SM120 GPU on this machine
        }
        return ansible_playbook(
            ROLLOUT, self.fleet.collections, extra, self.tmp, *flags, env=self.env
        )


def recap(output: str) -> dict[str, int]:
    line = next(x for x in output.splitlines() if x.startswith("localhost "))
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


@real
def test_rollout_check_diff_predicts_a_bare_node(fleet: Fleet, site: Path, tmp_path: Path):
    node = Node(fleet, site, tmp_path)
    untouched = snapshot(site, with_state=True)

    run = node.rollout("--check", "--diff")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    # The four tasks would change: the lock copied, the drop-in's directory and the drop-in
    # made, the files patched; the restart would run (a daemon-reload is "ok" in check mode).
    assert recap(out)["changed"] == 5 and recap(out)["failed"] == 0, out
    # the drop-in, from the play's variables: this venv's script, the node's lock, no GPU check
    script = fleet.python.parent / "sm120patch"
    assert f'+ExecStartPre="{script}" ensure --locked "{node.lock}" --no-gpu-check' in out, out
    for path in ("sglang/srt/server_args.py", "flashinfer/jit/comm.py"):
        assert f"+++ b/{path}" in out, out  # the diff the apply would write
    assert "RUNNING HANDLER [Reload systemd]" in out and "RUNNING HANDLER [Restart sglang]" in out
    # Nothing written anywhere: /etc empty, packages and state as they were, no systemctl action.
    assert list(node.etc.iterdir()) == []
    assert snapshot(site, with_state=True) == untouched
    assert [c for c in node.systemctl_calls() if not c.startswith("show ")] == []


@real
def test_rollout_applies_once_and_restarts_once(fleet: Fleet, site: Path, tmp_path: Path):
    node = Node(fleet, site, tmp_path)

    first = node.rollout("--diff")
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    assert node.lock.read_bytes() == fleet.lock.read_bytes()
    # its directory created; the guard runs the command the apply ran, on the same trees
    [line] = [x for x in node.drop_in.read_text().splitlines() if x.startswith("ExecStartPre=")]
    assert shlex.split(line[len("ExecStartPre=") :]) == [
        str(fleet.python.parent / "sm120patch"), "ensure", "--locked", str(node.lock),
        "--no-gpu-check", "--sglang", str(site), "--flashinfer", str(site),
    ]  # fmt: skip
    for f in lockfile.read(fleet.lock).files:
        assert snapshot(site)[f.path] == f.after, f.path
    calls = [c for c in node.systemctl_calls() if not c.startswith("show ")]
    assert calls == ["daemon-reload", "restart 'sglang.service'"] or calls == [
        "daemon-reload",
        "restart sglang.service",
    ], calls

    again = node.rollout()
    out = again.stdout + again.stderr
    assert again.returncode == 0, out
    assert recap(out)["changed"] == 0, out
    assert [c for c in node.systemctl_calls() if not c.startswith("show ")] == calls


@real
def test_rollout_failure_shows_the_refusal_not_the_trial_history(
    fleet: Fleet, site: Path, tmp_path: Path
):
    # A trial on record (the command exits at once: a crash, reverted, kept in the history);
    # fusion, as moe refuses the FlashInfer 0.6.1 of this fleet.
    trial = fleet.tool(
        "trial", "fusion", "--no-gpu-check", "--sglang", str(site), "--flashinfer", str(site),
        "--timeout", "30", "--json", "--", sys.executable, "-c", "raise SystemExit(3)",
    )  # fmt: skip
    assert trial.returncode == 3, trial.stdout + trial.stderr
    trial_id = json.loads(trial.stdout)["id"]
    status = fleet.tool("status", "--json", "--sglang", str(site), "--flashinfer", str(site))
    assert trial_id in status.stdout  # the tool keeps it
    # The node is patched by the lock, then a patched file is edited by hand.
    applied = fleet.tool(
        "apply", "--locked", str(fleet.lock), "--no-gpu-check",
        "--sglang", str(site), "--flashinfer", str(site),
    )  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    edited = site / "flashinfer" / "jit" / "comm.py"
    edited.write_text(edited.read_text() + "# a hand edit on the node\n")

    node = Node(fleet, site, tmp_path)
    run = node.rollout()
    out = run.stdout + run.stderr
    assert run.returncode == 2, out
    assert recap(out)["failed"] == 1
    assert "drifted" in out or "changed since" in out, out
    assert trial_id not in out and '"trials"' not in out, out
    assert [c for c in node.systemctl_calls() if not c.startswith("show ")] == []


def test_dockerignore_keeps_leftovers_out_and_the_sources_in():
    rules = (ROOT / ".dockerignore").read_text().splitlines()
    assert [rel for rel in LEFTOVERS if not dockerignored(rel, rules)] == []
    assert [rel for rel in checkout_files() if dockerignored(rel, rules)] == []
    assert not dockerignored("sm120patch.lock", rules)  # the Containerfile copies it


def test_dockerignore_matcher_reads_patterns_as_docker_does():
    rules = ["build", "**/__pycache__", "*.egg-info", "docs/*.html", "!docs/keep.html"]
    assert dockerignored("build/lib/x.py", rules)
    assert not dockerignored("sub/build/x.py", rules)  # anchored at the context root
    assert dockerignored("a/b/__pycache__/m.pyc", rules)
    assert dockerignored("pkg.egg-info/PKG-INFO", rules)
    assert dockerignored("docs/page.html", rules) and not dockerignored("docs/keep.html", rules)
    assert not dockerignored("docs/sub/page.html", rules)


@real
def test_image_source_holds_no_checkout_leftovers(fleet: Fleet):
    src = fleet.root / "image" / "src"
    assert (src / "pyproject.toml").is_file()
    assert [rel for rel in LEFTOVERS if (src / rel).exists()] == []
    assert not (src / "build").exists() and not list(src.glob("*.egg-info"))
    installed = fleet.site_packages / "sm120patch"
    assert not (installed / "stale_leftover.py").exists()


@real
def test_wheel_step_builds_from_a_clean_tree_whatever_the_context(fleet: Fleet, tmp_path: Path):
    """Without .dockerignore (another builder, another context) the wheel still holds only the
    sources: the step removes a stale build/ and *.egg-info before building."""
    context = build_context(tmp_path / "context", rules=[])
    assert (context / "build/lib/sm120patch/stale_leftover.py").is_file()
    prefix = tmp_path / "opt"
    run_containerfile(
        EXAMPLES / "Containerfile",
        context,
        build_args={"SRC": str(tmp_path / "src"), "PREFIX": str(prefix)},
        run_env={**os.environ, "PATH": f"{fleet.python.parent}{os.pathsep}{os.environ['PATH']}",
                 "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        log=tmp_path / "build.log",
        only=lambda word, rest: (word == "COPY" and rest.startswith(". "))
        or (word == "RUN" and "pip wheel" in rest),
    )  # fmt: skip
    (wheel,) = (prefix / "wheels").glob("sm120patch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sm120patch/cli.py" in names
    assert not [n for n in names if "stale_leftover" in n]
    assert f"sm120patch-{__version__}.dist-info/METADATA" in names


def test_collection_readme_matches_the_module():
    module = (COLLECTION / "plugins" / "modules" / "sm120patch.py").read_text()
    doc = yaml.safe_load(module.split('DOCUMENTATION = r"""', 1)[1].split('"""', 1)[0])
    options = doc["options"]
    readme = (COLLECTION / "README.md").read_text()
    table = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_]+)`", cells[0]):
                table[name] = cells[1].strip("`")
    assert sorted(table) == sorted(options)
    for name, option in options.items():
        if "default" in option and not isinstance(option["default"], type(None)):
            want = str(option["default"]).lower()
            assert table[name] == want, (name, table[name], want)
    # What the module does in check and diff mode for state: absent, in the README's words.
    assert "revert --dry-run" in readme and "no revert dry run" not in readme
    assert "returns no diff" not in readme
