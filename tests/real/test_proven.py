"""What the real tier proves, counted: the (patch, distinct site bytes, GPU) triples its site
checks (tests/real/test_sites.py) run on. Running a check once per distinct input
(realcache.ByBytes, `checked`) must never check fewer of them than running it per release did.
The real tier simulates no GPU: its triples are (patch, site bytes, "no GPU")."""

from __future__ import annotations

import pytest
from realcache import RealReleases, digest, full_run, site_cases

pytestmark = pytest.mark.real

# On the default release set at commit 35b7a77 (before the checks ran once per input), counted
# with that commit's own tests/real/realcache.py: 275 site cases.
PROVEN_BEFORE = {"sglang": 177, "flashinfer": 4, "vllm": 25}


def test_the_real_tier_checks_every_triple_it_checked_before(real: RealReleases) -> None:
    if full_run():
        pytest.skip("the figures are the default release set's")
    cases = site_cases()
    real.warm(cases)  # at once and in parallel (nothing left to do after test_sites.py)
    proven: dict[str, set[tuple[str, str, str]]] = {}
    for case in cases:
        run = real.site(case)
        proven.setdefault(str(case.kind), set()).add((case.patch_id, digest(run.before), "no GPU"))
    counts = {kind: len(triples) for kind, triples in proven.items()}
    for kind, before in PROVEN_BEFORE.items():
        assert counts.get(kind, 0) >= before, (kind, counts)
