"""What pip recorded of an installed target: the sha256 of each file its dist-info RECORD lists,
the release's own bytes that `revert` and `status` check against (none for a checkout)."""

from __future__ import annotations

from sm120patch.safeio import read_regular
from sm120patch.targets import DIST_NAMES, Target


def record_hashes(target: Target) -> dict[str, str]:
    """sha256 (hex) of each file as pip installed it, from the dist-info RECORD (module paths).

    An independent "as installed" reference: empty for a checkout, or when the RECORD has no
    hashes (editable installs, some installers).
    """
    import base64
    import csv

    if target.layout != "installed":
        return {}
    out: dict[str, str] = {}
    for dist in DIST_NAMES[target.kind]:
        for info in target.parent.glob(f"{dist}-*.dist-info"):
            try:
                rows = list(csv.reader(read_regular(info / "RECORD").decode("utf-8").splitlines()))
            except (OSError, UnicodeDecodeError):
                continue
            for row in rows:
                if len(row) >= 2 and row[1].startswith("sha256="):
                    raw = row[1].removeprefix("sha256=")
                    try:
                        digest = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
                    except ValueError:
                        continue
                    out[row[0]] = digest.hex()
    return out


def installed_beside(target: Target, dist: str) -> str | None:
    """The version of distribution `dist` installed in the same site-packages as an installed
    `target` (its `<dist>-<version>.dist-info` directory, the name only: nothing of it is read
    or imported), "" when it is not there, None for a checkout (whose Python this cannot
    tell)."""
    if target.layout != "installed":
        return None
    prefix = f"{dist}-"
    for info in sorted(target.parent.glob(f"{dist}-*.dist-info")):
        version = info.name.removeprefix(prefix).removesuffix(".dist-info")
        if version and "-" not in version:  # not another distribution named `<dist>-...`
            return version
    return ""
