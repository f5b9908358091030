"""A profile's refusal of another target's release holds whatever the order: moe patches SGLang
only and refuses a FlashInfer before 0.6.7. Applied where no FlashInfer is found, the apply says
that it was not checked and why it goes on; a refused FlashInfer installed afterwards makes
`status` say so and `ensure` refuse, on checkouts and installed packages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from trees import FLASHINFER_FILES, make_tree

from sm120patch.cli import main


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def install_flashinfer(site: Path, version: str) -> None:
    """FlashInfer `version` installed into `site` (over what is there)."""
    for old in site.glob("flashinfer_python-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    for rel, text in FLASHINFER_FILES.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    info = site / f"flashinfer_python-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {version}\n")


@pytest.mark.parametrize("layout", ["git", "installed"])
def test_moe_applied_without_flashinfer_says_so_then_a_refused_one_is_seen(layout, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", layout)
    # Installed: FlashInfer comes into SGLang's site-packages; a checkout runs with a
    # FlashInfer of a venv elsewhere, which the commands are then given.
    site = sg if layout == "installed" else tmp_path / "venv-site"
    site.mkdir(exist_ok=True)
    given = [] if layout == "installed" else ["--flashinfer", str(site)]
    code, out, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert "profile moe refuses FlashInfer <0.6.7, and no FlashInfer was found" in out
    assert "so that was not checked" in out
    code, out, err = cli("ensure", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert "and no FlashInfer was found" in out  # the service start says so too

    install_flashinfer(site, "0.6.8")
    code, out, _ = cli("status", "--sglang", str(sg), *given, "--json")
    sglang = next(t for t in json.loads(out)["targets"] if t["kind"] == "sglang")
    assert sglang["state"] == "applied" and "refuses" not in sglang["message"]
    assert cli("ensure", "moe", "--sglang", str(sg), *given, "--no-gpu-check")[0] == 0

    install_flashinfer(site, "0.6.1")
    code, out, _ = cli("status", "--sglang", str(sg), *given)
    assert code == 0
    assert "profile moe refuses FlashInfer 0.6.1 (flashinfer <0.6.7)" in out
    code, out, err = cli("ensure", "moe", "--sglang", str(sg), *given, "--no-gpu-check")
    assert code == 1
    assert "profile moe refuses FlashInfer 0.6.1" in err


def test_a_flashinfer_found_is_checked_and_no_note_is_made(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    install_flashinfer(sg, "0.6.8")
    code, out, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert "was not checked" not in out + err
