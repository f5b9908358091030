"""The collection's module through real ansible-playbook on localhost (connection: local).

Each test patches a private copy of real SGLang 0.5.8 + FlashInfer 0.6.1 (the `site` fixture)
with the sm120patch of the session's fresh venv, built from this checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import IMAGE_PROFILE, Fleet
from fleetkit import (
    COLLECTION,
    EXAMPLES,
    FQCN,
    ansible_bin,
    changed_files,
    playbook,
    snapshot,
)

from sm120patch import __version__
from sm120patch.maintain import trees
from sm120patch.plan import lockfile

pytestmark = [pytest.mark.real, pytest.mark.fleet]


def _module():
    """The module file itself, imported as Python, for its parser of the tool's errors."""
    spec = importlib.util.spec_from_file_location(
        "sm120patch_ansible_module", COLLECTION / "plugins" / "modules" / "sm120patch.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vars(fleet: Fleet, site: Path, **extra) -> dict:
    return {"site": str(site), "tool_python": str(fleet.python), **extra}


def _diff_files(diff: str) -> list[str]:
    return sorted(line[len("+++ b/") :] for line in diff.splitlines() if line.startswith("+++ b/"))


def _tool_error(proc: subprocess.CompletedProcess) -> tuple[str, str]:
    return _module().tool_error(proc.stdout, proc.stderr, proc.returncode)


def test_profile_lifecycle_check_apply_again_absent(fleet: Fleet, site: Path, tmp_path: Path):
    pristine = snapshot(site)
    untouched = snapshot(site, with_state=True)
    args = (fleet.collections, _vars(fleet, site, profile="fusion"), tmp_path)

    check = playbook("patch.yml", *args, "--check", "--diff")
    assert check.rc == 0, check.output
    assert check.recap["changed"] == 1 and check.result["changed"] is True
    assert snapshot(site, with_state=True) == untouched  # check mode wrote nothing anywhere
    diff = check.result["diff"]["prepared"]
    assert _diff_files(diff) == [
        "flashinfer/jit/comm.py",
        "sglang/srt/layers/communicator.py",
        "sglang/srt/server_args.py",
    ]
    assert "+++ b/flashinfer/jit/comm.py" in check.output  # shown by --diff, not only returned
    applies = subprocess.run(
        ["git", "apply", "--check", "-p1", "-"],
        cwd=site,
        input=diff,
        text=True,
        capture_output=True,
    )
    assert applies.returncode == 0, applies.stderr
    outcomes = {o["patch"]: o["status"] for o in check.result["outcomes"]}
    assert outcomes["sglang.fusion-gate"] == "applied"
    assert outcomes["flashinfer.comm-arch"] == "applied"

    first = playbook("patch.yml", *args, "--diff")
    assert first.rc == 0, first.output
    assert first.recap["changed"] == 1 and first.result["action"] == "applied"
    assert first.result["diff"]["prepared"] == diff
    patched = snapshot(site)
    assert changed_files(pristine, patched) == _diff_files(diff)
    assert {t["kind"]: t["profile"] for t in first.result["targets"]} == {
        "sglang": "fusion",
        "flashinfer": "fusion",
    }

    second = playbook("patch.yml", *args)
    assert second.rc == 0, second.output
    assert second.recap["changed"] == 0 and second.result["changed"] is False
    assert second.result["action"] == "nothing-to-do"
    assert snapshot(site) == patched

    args = (fleet.collections, _vars(fleet, site, profile="fusion", wanted_state="absent"), tmp_path)
    applied_state = snapshot(site, with_state=True)
    predicted = playbook("patch.yml", *args, "--check", "--diff")
    assert predicted.rc == 0, predicted.output
    assert predicted.result["changed"] is True and predicted.result["action"] == "reverted"
    assert snapshot(site, with_state=True) == applied_state
    # The revert's dry run: its diff is the patch's, the other way round.
    back = predicted.result["diff"]["prepared"]
    assert _diff_files(back) == _diff_files(diff)
    undoes = subprocess.run(["git", "apply", "--check", "-p1", "-"], cwd=site, input=back,
                            text=True, capture_output=True)  # fmt: skip
    assert undoes.returncode == 0, undoes.stderr

    # An edit after the apply: check mode refuses as the revert does, with its words.
    server_args = site / "sglang/srt/server_args.py"
    edited = server_args.read_bytes()
    server_args.write_bytes(edited + b"# an operator's edit\n")
    refused = playbook("patch.yml", *args, "--check")
    assert refused.rc != 0 and "changed since" in refused.output, refused.output
    server_args.write_bytes(edited)

    reverted = playbook("patch.yml", *args)
    assert reverted.rc == 0, reverted.output
    assert reverted.recap["changed"] == 1
    assert snapshot(site) == pristine  # byte for byte
    assert all(t["profile"] is None for t in reverted.result["targets"])

    # Without `python`, the module runs the sm120patch on the host's PATH (here: the venv's).
    bare = {k: v for k, v in args[1].items() if k != "tool_python"}
    on_path = {**os.environ, "PATH": f"{fleet.python.parent}{os.pathsep}{os.environ['PATH']}"}
    again = playbook("patch.yml", args[0], bare, tmp_path, env=on_path)
    assert again.rc == 0, again.output
    assert again.recap["changed"] == 0 and again.result["changed"] is False
    assert again.result["cmd"][0][0] == str(fleet.python.parent / "sm120patch")


def test_lock_handler_runs_once_after_a_change_and_not_on_the_second_run(
    fleet: Fleet, site: Path, tmp_path: Path
):
    restarts = tmp_path / "restarts.log"
    extra = _vars(fleet, site, lock=str(fleet.lock), restart_log=str(restarts))

    first = playbook("handler.yml", fleet.collections, extra, tmp_path)
    assert first.rc == 0, first.output
    assert first.recap["changed"] == 2  # the task and its handler
    assert restarts.read_text().splitlines() == ["restarted"]
    for f in lockfile.read(fleet.lock).files:
        assert snapshot(site)[f.path] == f.after

    second = playbook("handler.yml", fleet.collections, extra, tmp_path)
    assert second.rc == 0, second.output
    assert second.recap["changed"] == 0
    assert "RUNNING HANDLER" not in second.output
    assert restarts.read_text().splitlines() == ["restarted"]


def test_lock_for_another_release_fails_in_check_mode(fleet: Fleet, site: Path, tmp_path: Path):
    other = tmp_path / "0.5.9.lock"
    pinned = fleet.tool(
        "pin",
        "fusion",  # moe refuses the FlashInfer 0.6.1 of this fleet
        "--sglang",
        str(trees.tree("sglang", "0.5.9")),
        "--flashinfer",
        str(trees.tree("flashinfer", "0.6.1")),
        "-o",
        str(other),
        state=tmp_path / "pin-state",
    )
    assert pinned.returncode == 0, pinned.stderr
    before = snapshot(site, with_state=True)

    run = playbook(
        "patch.yml", fleet.collections, _vars(fleet, site, lock=str(other)), tmp_path, "--check"
    )
    assert run.rc == 2, run.output  # ansible-playbook: a task failed
    assert run.recap["failed"] == 1 and run.result["failed"] is True
    assert "sglang version: lock has 0.5.9, found 0.5.8" in run.result["msg"]
    assert snapshot(site, with_state=True) == before  # wrote nothing anywhere
    # The failed task still says what the targets are in.
    assert {t["kind"]: t["profile"] for t in run.result["targets"]} == {
        "sglang": None,
        "flashinfer": None,
    }
    # The failure is the tool's own message and hint, as the tool prints them.
    direct = fleet.tool(
        "apply",
        "--locked",
        str(other),
        "--dry-run",
        "--no-gpu-check",
        "--sglang",
        str(site),
        "--flashinfer",
        str(site),
        "--json",
    )
    message, hint = _tool_error(direct)
    assert run.result["error"] == message and run.result["next"] == hint
    assert hint and hint in run.result["msg"]


def test_gpu_check_fails_in_check_mode_as_the_apply_does(fleet: Fleet, site: Path, tmp_path: Path):
    from sm120patch.trial import gpu

    if gpu.read_gpus().has_sm120:
        pytest.skip("this machine has an SM120 GPU: the GPU precondition holds here")
    before = snapshot(site)
    # fusion: moe refuses the FlashInfer 0.6.1 of this fleet before the GPU is asked about
    args = (fleet.collections, _vars(fleet, site, profile="fusion", gpu_check=True), tmp_path)

    check = playbook("patch.yml", *args, "--check")
    assert check.rc == 2, check.output
    assert check.result["msg"].startswith("no SM120 GPU here")
    assert "gpu_check: false" in check.result["next"]

    run = playbook("patch.yml", *args)
    assert run.rc == 2, run.output
    direct = fleet.tool(
        "apply", "fusion", "--sglang", str(site), "--flashinfer", str(site), "--json"
    )
    assert direct.returncode == 1
    assert (run.result["error"], run.result["next"]) == _tool_error(direct)
    assert snapshot(site) == before


def test_drifted_file_fails_the_task_with_the_tools_message(
    fleet: Fleet, site: Path, tmp_path: Path
):
    applied = fleet.tool(
        "apply", "fusion", "--no-gpu-check", "--sglang", str(site), "--flashinfer", str(site)
    )
    assert applied.returncode == 0, applied.stderr
    edited = site / "flashinfer" / "jit" / "comm.py"
    edited.write_text(edited.read_text() + "# a hand edit on the node\n")
    before = snapshot(site)

    run = playbook("patch.yml", fleet.collections, _vars(fleet, site, profile="fusion"), tmp_path)
    assert run.rc == 2, run.output
    assert run.result["failed"] is True and run.result["changed"] is False
    assert snapshot(site) == before  # the edit is kept
    direct = fleet.tool(
        "apply", "fusion", "--no-gpu-check", "--sglang", str(site), "--flashinfer", str(site), "--json"
    )
    assert direct.returncode == 1
    message, hint = _tool_error(direct)
    assert run.result["error"] == message and run.result["next"] == hint
    assert run.result["state"]["flashinfer"] == "drifted"


def test_check_mode_on_an_applied_lock_reports_ok(fleet: Fleet, site: Path, tmp_path: Path):
    applied = fleet.tool(
        "apply",
        "--locked",
        str(fleet.lock),
        "--no-gpu-check",
        "--sglang",
        str(site),
        "--flashinfer",
        str(site),
    )
    assert applied.returncode == 0, applied.stderr
    run = playbook(
        "patch.yml",
        fleet.collections,
        _vars(fleet, site, lock=str(fleet.lock)),
        tmp_path,
        "--check",
    )
    assert run.rc == 0, run.output
    assert run.result["changed"] is False


def test_results_name_the_target_state(fleet: Fleet, site: Path, tmp_path: Path):
    run = playbook(
        "patch.yml", fleet.collections, _vars(fleet, site, profile=IMAGE_PROFILE), tmp_path
    )
    assert run.rc == 0, run.output
    assert run.result["state"] == {"sglang": "applied", "flashinfer": "applied"}


def test_a_vllm_profile_through_the_module(fleet: Fleet, site: Path, tmp_path: Path):
    """vllm-moe on a copy of the real newest vLLM's sources: check mode's diff, the apply, a
    second run that changes nothing, and state=absent back to the release's bytes."""
    from sm120patch.maintain import releases, sources

    version = releases.DEFAULT_RELEASES["vllm"][-1]
    vllm_site = tmp_path / "vllm-site"
    for entry in sources.tree("vllm", version).iterdir():
        if entry.is_dir():
            shutil.copytree(entry, vllm_site / entry.name)
    pristine = snapshot(vllm_site)
    extra = {"profile": "vllm-moe", "vllm_site": str(vllm_site)}
    args = (fleet.collections, _vars(fleet, site, **extra), tmp_path)

    check = playbook("patch.yml", *args, "--check", "--diff")
    assert check.rc == 0, check.output
    assert _diff_files(check.result["diff"]["prepared"]) == [
        "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"
    ]
    assert snapshot(vllm_site) == pristine
    applied = playbook("patch.yml", *args)
    assert applied.rc == 0 and applied.result["changed"] is True, applied.output
    assert applied.result["state"]["vllm"] == "applied"
    assert changed_files(pristine, snapshot(vllm_site)) == [
        "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"
    ]
    again = playbook("patch.yml", *args)
    assert again.rc == 0 and again.result["changed"] is False, again.output
    gone = playbook("patch.yml", fleet.collections,
                    _vars(fleet, site, **extra, wanted_state="absent"), tmp_path)
    assert gone.rc == 0 and gone.result["changed"] is True, gone.output
    assert snapshot(vllm_site) == pristine
    # Without `vllm`, the task fails with the tool's one line, nothing changed.
    unnamed = playbook("patch.yml", fleet.collections, _vars(fleet, site, profile="vllm-moe"),
                       tmp_path)
    assert unnamed.rc != 0 and "vLLM is looked for only where" in unnamed.result["msg"]


def test_collection_documents_its_arguments_and_builds(fleet: Fleet, tmp_path: Path):
    env = {
        "ANSIBLE_COLLECTIONS_PATH": str(fleet.collections),
        "ANSIBLE_HOME": str(tmp_path / "home"),
        "PATH": str(Path(sys.executable).parent),
    }
    doc = subprocess.run(
        [ansible_bin("ansible-doc"), "--json", FQCN], env=env, capture_output=True, text=True
    )
    assert doc.returncode == 0, doc.stderr
    options = json.loads(doc.stdout)[FQCN]["doc"]["options"]
    assert sorted(options) == sorted(
        [
            "profile",
            "lock",
            "lock_content",
            "state",
            "sglang",
            "flashinfer",
            "vllm",
            "python",
            "force",
            "gpu_check",
        ]
    )
    built = subprocess.run(
        [
            ansible_bin("ansible-galaxy"),
            "collection",
            "build",
            str(COLLECTION),
            "--output-path",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / f"sm120-sm120patch-{__version__}.tar.gz").is_file()  # the tool's version


def test_example_playbooks_pass_syntax_check(fleet: Fleet, tmp_path: Path):
    env = {
        "ANSIBLE_COLLECTIONS_PATH": str(fleet.collections),
        "ANSIBLE_HOME": str(tmp_path / "home"),
        "PATH": str(Path(sys.executable).parent),
    }
    for book in sorted((EXAMPLES / "ansible").glob("*.yml")):
        proc = subprocess.run(
            [ansible_bin("ansible-playbook"), "-i", "localhost,", "--syntax-check", str(book)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, f"{book.name}: {proc.stdout}{proc.stderr}"


def test_error_parser_reads_the_tools_errors(fleet: Fleet, tmp_path: Path):
    """Whichever form this sm120patch prints (JSON on stdout, or text on stderr)."""
    missing = fleet.tool("apply", "--locked", str(tmp_path / "nope.lock"), "--json")
    assert missing.returncode == 2
    message, hint = _tool_error(missing)
    assert message == f"lock file {tmp_path / 'nope.lock'} does not exist"
    # An interpreter without sm120patch: Python's own error, and where to look.
    bare = subprocess.run(
        [sys.executable, "-I", "-m", "sm120patch_not_installed", "status"],
        capture_output=True,
        text=True,
    )
    message, hint = _module().tool_error(bare.stdout, bare.stderr, bare.returncode)
    assert message.startswith("sm120patch exited 1: ") and "No module named" in message
    assert "installed for the interpreter" in hint
    # The contract of the JSON errors, as the module must read it.
    doc = {"error": "profile all is not applied", "next": "see `sm120patch status`", "exit_code": 1}
    assert _module().tool_error(json.dumps(doc), "", 1) == (doc["error"], doc["next"])
    # A multi-line message (revert shows the edit it would discard) keeps its lines.
    text = "sm120patch: x: changed since the apply:\n--- a\n+++ b\n  next: revert --force\n"
    assert _module().tool_error("", text, 1) == (
        "x: changed since the apply:\n--- a\n+++ b",
        "revert --force",
    )
