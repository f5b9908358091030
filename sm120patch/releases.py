"""The release cache moved to `sm120patch.maintain.releases` (maintainer tooling). This name is
that very module, so code and tests written against the old path keep working, monkeypatching
included; runtime commands import neither (tests/test_matrix_imports.py)."""

import sys

from sm120patch.maintain import releases as _releases

sys.modules[__name__] = _releases
