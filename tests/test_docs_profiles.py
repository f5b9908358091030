"""The profile tables of docs/compatibility.md say what patches/profiles.toml says: each
profile's status, patches and pins (and, for the vLLM profiles, whether a FlashInfer is
refused). The tables are written by hand; this holds them to the catalog."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from sm120patch.plan import catalog

COMPAT = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"

PIN_COLUMNS = {"SGLang pins": "sglang", "FlashInfer pins": "flashinfer", "vLLM pins": "vllm"}


def profile_rows(text: str) -> list[dict[str, str]]:
    """Every row of every table under "Profiles and pins" whose first column is a profile."""
    section = text.split("## Profiles and pins", 1)[1].split("\n## ", 1)[0]
    rows: list[dict[str, str]] = []
    head: list[str] = []
    for line in section.splitlines():
        if not line.startswith("|"):
            head = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not head:
            head = cells
        elif not set(line) <= set("|- "):
            rows.append(dict(zip(head, cells, strict=True)))
    return rows


def problems(text: str) -> list[str]:
    cat = catalog.load()
    found: list[str] = []
    rows = profile_rows(text)
    named = {r["profile"].strip("`") for r in rows}
    missing = sorted(set(cat.profiles) - named)
    if missing:
        found.append(f"profiles with no row: {missing}")
    for row in rows:
        name = row["profile"].strip("`")
        profile = cat.profiles.get(name)
        if profile is None:
            found.append(f"{name}: no such profile")
            continue
        if not row["status"].startswith(profile.status):
            found.append(f"{name}: status {row['status']!r}, the catalog says {profile.status}")
        listed = re.findall(r"`([^`]+)`", row["patches"])
        if listed and tuple(listed) != profile.patches:
            found.append(f"{name}: patches {listed}, the catalog says {list(profile.patches)}")
        for column, kind in PIN_COLUMNS.items():
            if column not in row:
                continue
            spec = re.match(r"`([^`]+)`", row[column])
            pin = profile.pins.get(kind)
            if (SpecifierSet(spec.group(1)) if spec else None) != pin:
                found.append(f"{name}: {column} {row[column]!r}, the catalog says {pin}")
        if "FlashInfer" in row:  # the vLLM table: a FlashInfer refusal or none
            refuses = any(r.kind == "flashinfer" for r in profile.refuse)
            if ("refused" in row["FlashInfer"]) is not refuses:
                found.append(f"{name}: FlashInfer {row['FlashInfer']!r}")
    return found


def test_the_profile_tables_say_what_the_catalog_says() -> None:
    text = COMPAT.read_text(encoding="utf-8")
    assert len(profile_rows(text)) == len(catalog.load().profiles)
    assert problems(text) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("| `vllm-moe` | experimental |", "| `vllm-moe` | recommended |"),
        ("`>=0.30.0,<0.35` | before 0.6.17 refused", "`>=0.30.0,<0.36` | before 0.6.17 refused"),
        ("before 0.6.17 refused |", "(none) |"),
        ("| `vllm.pcie-allreduce` |", "| `vllm.moe-b12x` |"),
        ("| `vllm-fp8-moe` |", "| `vllm-fp8` |"),
    ],
)
def test_the_check_catches_a_wrong_row(old: str, new: str) -> None:
    text = COMPAT.read_text(encoding="utf-8")
    assert old in text
    assert problems(text.replace(old, new, 1)) != []


PROFILES_DOC = COMPAT.parent / "profiles.md"
README = COMPAT.parents[1] / "README.md"


def _table(text: str, head: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header line starts with `head`."""
    lines = text[text.index(head) :].splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    rows = []
    for row in cells[2:]:
        if not lines[len(rows) + 2].startswith("|"):
            break
        rows.append(dict(zip(cells[0], row, strict=True)))
    return rows


def test_the_profiles_page_has_a_row_per_profile_with_its_status() -> None:
    # The README's profile table moved to docs/profiles.md: held to the catalog as it was.
    cat = catalog.load()
    rows = _table(PROFILES_DOC.read_text(encoding="utf-8"), "| profile | status | what it does")
    assert sorted(r["profile"].strip("`") for r in rows) == sorted(cat.profiles)
    for row in rows:
        assert row["status"].startswith(cat.profiles[row["profile"].strip("`")].status), row


def test_the_readme_is_short_and_its_box_table_names_real_profiles() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    rows = _table(text, "| your box | use |")
    named = {n for r in rows for n in re.findall(r"`([a-z0-9-]+)`", r["use"])}
    assert named and named <= set(catalog.load().profiles), named
    # the model family, NVFP4 or not, GPU count and topology each lead somewhere
    boxes = " ".join(r["your box"] for r in rows)
    for word in ("NVFP4", "not NVFP4", "GPU count", "PCIe-only", "TP2"):
        assert word in boxes, word
