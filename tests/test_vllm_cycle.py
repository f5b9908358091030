"""A profile that patches vLLM, through every verb the operator runs (vllm-moe on a vLLM of our
own in its shape: tests/real/test_cycle_vllm.py runs the same on the real 0.34.0): the dry run's
diff, apply, status, ensure twice, pin, apply --locked on a fresh copy, ensure --locked and revert
byte for byte, installed and as a checkout; and, with no --vllm, one refusal whose `next:` is a
command that pastes as it is."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
import trees
from click.testing import CliRunner
from test_vllm_moe_b12x import HUMMING
from trees import VLLM_SCM_PYPROJECT, commit_all, init_repo, tree_hash

from sm120patch.cli import main
from sm120patch.errors import AGAIN

ORACLE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def files(parent: Path, extra: dict[str, str] | None = None) -> None:
    for rel, text in {**trees.VLLM_FILES, ORACLE: HUMMING, **(extra or {})}.items():
        (parent / rel).parent.mkdir(parents=True, exist_ok=True)
        (parent / rel).write_text(text)


def installed(base: Path, extra: dict[str, str] | None = None) -> Path:
    """vLLM 0.34.0 as pip installs it: the package (with `extra` files), its dist-info and a
    RECORD of its hashes."""
    site = base / "site"
    files(site, extra)
    info = site / "vllm-0.34.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n")
    rows = []
    for path in sorted((site / "vllm").rglob("*.py")):
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
        rows.append(f"{path.relative_to(site).as_posix()},sha256={digest.rstrip(b'=').decode()},0")
    (info / "RECORD").write_text("\n".join(rows) + "\n")
    return site


def checkout(base: Path) -> Path:
    """A vLLM checkout as upstream keeps one: the package at the root, setuptools-scm, the
    release tagged v0.34.0 on its release branch."""
    root = base / "vllm"
    files(root)
    (root / "pyproject.toml").write_text(VLLM_SCM_PYPROJECT)
    (root / ".gitignore").write_text("vllm/_version.py\n__pycache__/\n")
    init_repo(root)
    commit_all(root, "main")
    trees.git(root, "checkout", "-q", "-b", "releases/v0.34.0")
    commit_all(root, "release 0.34.0")
    trees.git(root, "tag", "-a", "-m", "v0.34.0", "v0.34.0")
    return root


@pytest.mark.parametrize("layout", ["installed", "git"])
def test_the_operators_cycle_on_a_vllm(layout: str, tmp_path: Path) -> None:
    make = installed if layout == "installed" else checkout
    root = make(tmp_path / "box")
    v = ["--vllm", str(root)]
    before = tree_hash(root)
    code, out, err = cli("apply", "vllm-moe", *v, "--dry-run")
    assert code == 0, err
    assert f"+++ b/{ORACLE}" in out and "+            NvFp4MoeBackend.FLASHINFER_B12X," in out
    assert tree_hash(root) == before
    code, _, err = cli("apply", "vllm-moe", *v, "--no-gpu-check")
    assert code == 0, err
    code, out, err = cli("status", *v, "--json")
    [target] = json.loads(out)["targets"]
    assert (target["kind"], target["version"], target["state"], target["profile"]) == (
        "vllm", "0.34.0", "applied", "vllm-moe")  # fmt: skip
    for _ in range(2):
        code, out, err = cli("ensure", "vllm-moe", *v, "--no-gpu-check")
        assert code == 0 and "nothing was changed" in out, err
    lock = tmp_path / "vllm.lock"
    code, _, err = cli("pin", "vllm-moe", *v, "-o", str(lock))
    assert code == 0, err
    assert '[versions]\nvllm = "0.34.0"' in lock.read_text()
    assert f'target = "vllm"\npath = "{ORACLE}"' in lock.read_text()

    if layout == "installed":
        copy = installed(tmp_path / "copy")
    else:
        copy = tmp_path / "clone"
        trees.git(tmp_path, "clone", "-q", "--branch", "releases/v0.34.0", str(root), str(copy))
    copy_before = tree_hash(copy)
    for verb in ("apply", "ensure"):
        code, _, err = cli(verb, "--locked", str(lock), "--vllm", str(copy), "--no-gpu-check")
        assert code == 0, f"{verb} --locked: {err}"
    assert (copy / ORACLE).read_text() == (root / ORACLE).read_text() != HUMMING
    for r, was in ((root, before), (copy, copy_before)):
        code, _, err = cli("revert", "--all", "--vllm", str(r))
        assert code == 0, err
        assert tree_hash(r) == was


@pytest.mark.parametrize(
    "verb",
    [("apply", "vllm-moe", "--no-gpu-check"), ("apply", "vllm-moe", "--dry-run"),
     ("ensure", "vllm-moe"), ("pin", "vllm-moe", "-o", "x.lock")],  # fmt: skip
    ids=lambda v: v[0] + ("-dry-run" if "--dry-run" in v else ""),
)
def test_a_vllm_profile_without_vllm_refuses_with_a_command_that_pastes(
    verb: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(*verb)
    assert code == 1 and not (tmp_path / "x.lock").exists(), out
    # the profile's known outcomes may come first (a dry run shows them before planning)
    lines = err.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("sm120patch: ")):]
    assert lines[0] == ("sm120patch: vLLM is looked for only where the command names it, "
                        "and this one does not")  # fmt: skip
    [command] = [line.removeprefix("  next: ") for line in lines if line.startswith("  next: ")]
    assert command.startswith("python3 -c ") and "vllm.__file__" in command
    assert "PATH" not in command and "<" not in command


def test_a_vllm_in_this_python_is_named_in_the_hint_never_patched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = installed(tmp_path)
    monkeypatch.syspath_prepend(str(site))
    before = tree_hash(site)
    code, _, err = cli("apply", "vllm-moe", "--no-gpu-check")
    assert code == 1 and tree_hash(site) == before
    [command] = [line.removeprefix("  next: ") for line in err.splitlines()
                 if line.startswith("  next: ")]  # fmt: skip
    assert command == f"sm120patch apply vllm-moe --no-gpu-check --vllm {site.resolve()}"
    assert AGAIN not in err
    code, _, err = cli(*command.split()[1:])
    assert code == 0, err


def test_a_profile_refused_by_design_says_why_first_even_with_another_applied(
    tmp_path: Path,
) -> None:
    """vllm-fp8-moe never writes: with vllm-moe applied its refusal is still the gate's reason,
    not "revert vllm-moe first, then apply vllm-fp8-moe" (a revert for nothing)."""
    from test_vllm_fp8_cutlass_moe import custom_ops

    site = installed(tmp_path, {"vllm/_custom_ops.py": custom_ops()})
    v = ["--vllm", str(site)]
    code, _, err = cli("apply", "vllm-moe", *v, "--no-gpu-check")
    assert code == 0, err
    applied = tree_hash(site)
    code, _, err = cli("apply", "vllm-fp8-moe", *v, "--no-gpu-check")
    assert code == 1
    assert "refused at vllm/_custom_ops.py::cutlass_group_gemm_supported" in err, err
    assert "revert" not in err and "is applied on" not in err, err
    assert tree_hash(site) == applied
