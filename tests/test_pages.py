"""Pages a person reads: `show` wraps at the terminal's width (100 columns where stdout is no
terminal) with its summary first and the known outcomes in full after it; `status` prints no
empty profile header; `doctor` names a site as `apply` does (`<file>`, never `::<file>`)."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner
from test_as_wanted import pair  # noqa: F401
from test_states import cli
from trees import make_tree

from sm120patch import terminal
from sm120patch.cli import main
from sm120patch.plan import catalog


def _too_wide(out: str, width: int) -> list[str]:
    """Lines over `width` but those that are one word (a URL, a path) after their indent."""
    return [line for line in out.splitlines() if len(line) > width and len(line.split()) > 1]


@pytest.mark.parametrize("name", sorted(catalog.load().profiles))
def test_show_wraps_at_100_columns_off_a_terminal_summary_first(name):
    code, out, err = cli("show", name)
    assert code == 0, err
    assert not _too_wide(out, 100), _too_wide(out, 100)
    lines = out.splitlines()
    ids = {f"  patch {p}:" for p in catalog.load().profiles[name].patches}
    patch_lines = [i for i, line in enumerate(lines) if line.split(" ", 4)[:4] and
                   " ".join(line.split(" ", 4)[:4]) in ids]  # fmt: skip
    assert patch_lines and patch_lines[-1] < lines.index(""), "one line per patch, first"
    if "Known outcomes about" in out:
        full = lines.index(f"Known outcomes about {name}, in full:")
        head = lines[: lines.index("")]  # the summary: up to the first blank line
        summary = [line for line in head if line.startswith("  known: ")]
        assert summary and full < len(lines) - 1, out
        assert len(summary) == len([x for x in lines[full:] if x.startswith("  known: ")])


def test_show_on_a_terminal_wraps_at_its_width(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a: shutil.os.terminal_size((72, 40)))
    assert terminal.page_width() == 72
    width = terminal.page_width
    monkeypatch.setattr("sm120patch.render.page_width", lambda: 72)
    out = CliRunner().invoke(main, ["show", "moe"]).stdout
    assert not _too_wide(out, 72) and max(len(x) for x in out.splitlines()) > 60
    monkeypatch.setattr("sys.stdout.isatty", lambda: False, raising=False)
    assert width() == 100


def test_status_prints_no_empty_profile_header(pair):  # noqa: F811
    layout, sg, fi, where = pair
    assert cli("apply", "fusion", *where, "--no-gpu-check")[0] == 0
    code, out, err = cli("status", *where)
    assert code == 0, err
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("profile fusion") and line.strip() == "profile fusion":
            assert i + 1 < len(lines) and lines[i + 1].startswith("    "), out
    assert "needs nothing here" in out


def test_doctor_names_a_site_without_a_file_as_apply_does(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    code, out, err = cli("doctor", "--sglang", str(sg), "--flashinfer", str(fi))
    assert "not-applicable" in out, out + err
    assert "::<file>" not in out and "<file>" in out, out
