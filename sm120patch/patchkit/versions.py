"""The two ways a version counts as a release, named, and used everywhere a version is compared.

- `base_release`: what a pin or a known outcome means by a release. A `.postN` hotfix, a dev
  build and a checkout's local version count as the release they patch: 0.5.9.post1,
  0.5.9.dev12 and 0.5.9+12.gabc are all 0.5.9 for `sglang = ">=0.5.8,<0.5.10"`.
- `own_release`: what a fact (the code at a site) and a target's identity mean by a release. A
  `.postN` hotfix is its own release (0.5.4.post3 already carries what 0.5.4 lacks); only a
  checkout's local part is dropped (0.5.9+12.gabc is 0.5.9).

Both return None for a string that is not a PEP 440 version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet


def base_release(version: str) -> Version | None:
    try:
        return Version(Version(version).base_version)
    except InvalidVersion:
        return None


def own_release(version: str) -> Version | None:
    try:
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def contains(spec: str | SpecifierSet, version: Version | None) -> bool:
    """Whether the PEP 440 specifier `spec` admits `version` (pre-releases included: a
    release candidate of a pinned release is that release's code); False for no version."""
    from packaging.specifiers import SpecifierSet

    return version is not None and SpecifierSet(str(spec)).contains(version, prereleases=True)
