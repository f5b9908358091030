"""The compatibility table (docs/compatibility.md) is `matrix`'s output: every row of the default release set
must appear in it exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from realcache import release_set

from sm120patch.maintain import matrix

pytestmark = pytest.mark.real

COMPAT = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def compat_table() -> list[str]:
    text = COMPAT.read_text(encoding="utf-8")
    start, end = text.index("<!-- matrix:begin -->"), text.index("<!-- matrix:end -->")
    return text[start:end].splitlines()


def test_compatibility_table_matches_matrix(real) -> None:
    work = [(kind, v) for kind in matrix.ORDER for v in release_set(kind)]
    rows = matrix.run(work, jobs=2)
    assert not [r for r in rows if r.error]
    ours = compat_table()
    produced = [line for line in matrix.markdown(rows).splitlines() if line.strip()]
    missing = [line for line in produced if line not in ours]
    assert missing == [], (
        "docs/compatibility.md table out of date; regenerate with `sm120patch matrix --markdown`"
        " and `sm120patch matrix --vllm '' --markdown`"
    )
