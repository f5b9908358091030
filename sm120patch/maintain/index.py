"""Read what a package index lists for one project: the index pages and find-links locations
pip is configured with (pipconfig.py), as PEP 691 JSON or PEP 503 HTML, over http(s) or from
local directories (`file://` indexes and find-links directories).

Nothing here caches or prints: `read_project` returns the files found and, per location that
could not be read, why. A location that does not hold the project (HTTP 404, a missing local
directory) is not a problem: indexes other than the first rarely hold every project.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from sm120patch.maintain.pipconfig import PipIndex

ACCEPT = (
    "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
    "text/html;q=0.01"
)
TIMEOUT_S = 15.0
# What reading a location may raise: URLError and HTTPError are OSErrors; a connection cut
# mid-page is an http.client.HTTPException; a garbled page a ValueError.
READ_ERRORS = (OSError, ValueError, http.client.HTTPException)


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    version: Version
    wheel: bool
    yanked: bool


def parse_filename(filename: str) -> tuple[str, Version, bool] | None:
    """(canonical project name, version, is a wheel) of a distribution file name, or None."""
    try:
        if filename.endswith(".whl"):
            name, version, _build, _tags = parse_wheel_filename(filename)
            return name, version, True
        if filename.endswith((".tar.gz", ".zip")):
            name, version = parse_sdist_filename(filename)
            return name, version, False
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None
    return None


def make_file(
    project: str, filename: str, url: str, sha256: str | None, yanked: bool
) -> IndexFile | None:
    """An IndexFile when `filename` is a distribution of `project`, else None."""
    parsed = parse_filename(filename)
    if parsed is None or parsed[0] != canonicalize_name(project):
        return None
    _, version, wheel = parsed
    return IndexFile(filename, url, sha256, version, wheel, yanked)


def redact(url: str) -> str:
    """`url` without the user:password a private index URL may carry."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def open_url(
    url: str, *, accept: str = "*/*", cert: str | None = None, timeout: float = TIMEOUT_S
) -> Any:  # a response: http.client.HTTPResponse or urllib's addinfourl
    """urlopen with the credentials a URL carries sent as basic auth, and pip's `cert`."""
    parts = urllib.parse.urlsplit(url)
    headers = {"Accept": accept}
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        token = base64.b64encode(urllib.parse.unquote(userinfo).encode()).decode()
        headers["Authorization"] = f"Basic {token}"
        url = redact(url)
    context = None
    if parts.scheme == "https" and cert and os.path.exists(cert):
        context = ssl.create_default_context(cafile=cert)
    request = urllib.request.Request(url, headers=headers)
    return urllib.request.urlopen(request, timeout=timeout, context=context)


class _Anchors(HTMLParser):
    """(href, data-yanked present) of every <a> of a PEP 503 page or a find-links page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, bool]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            found = dict(attrs)
            if found.get("href"):
                self.links.append((str(found["href"]), "data-yanked" in found))


def parse_html(project: str, text: str, base: str) -> list[IndexFile]:
    parser = _Anchors()
    parser.feed(text)
    files = []
    for href, yanked in parser.links:
        url = urllib.parse.urljoin(base, href)
        clean, _, fragment = url.partition("#")
        name = urllib.parse.unquote(clean.rsplit("/", 1)[-1].split("?", 1)[0])
        algo, _, digest = fragment.partition("=")
        file = make_file(project, name, clean, digest if algo == "sha256" else None, yanked)
        if file:
            files.append(file)
    return files


def parse_json(project: str, data: dict[str, Any], base: str) -> list[IndexFile]:
    files = []
    for raw in data.get("files", []):
        url = urllib.parse.urljoin(base, raw.get("url", ""))
        sha = (raw.get("hashes") or {}).get("sha256")
        file = make_file(project, raw.get("filename", ""), url, sha, bool(raw.get("yanked")))
        if file:
            files.append(file)
    return files


def _local_dir(project: str, directory: Path) -> list[IndexFile]:
    """A directory of distribution files (find-links), or one with a PEP 503 index.html."""
    page = directory / "index.html"
    if page.is_file():
        return parse_html(project, page.read_text(encoding="utf-8"), page.as_uri())
    found = (make_file(project, p.name, p.as_uri(), None, False) for p in directory.iterdir())
    return [f for f in found if f]


def _local(project: str, path: Path) -> list[IndexFile]:
    if path.is_dir():
        return _local_dir(project, path)
    if path.is_file():
        return parse_html(project, path.read_text(encoding="utf-8"), path.as_uri())
    return []  # pip ignores it too ("neither a file nor a directory")


def _remote(project: str, url: str, cert: str | None) -> list[IndexFile]:
    try:
        with open_url(url, accept=ACCEPT, cert=cert) as response:
            kind = response.headers.get("Content-Type", "")
            body = response.read()
            base = redact(response.geturl())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise
    if "json" in kind:
        return parse_json(project, json.loads(body), base)
    return parse_html(project, body.decode("utf-8", "replace"), base)


def read_location(
    project: str, location: str, *, index: bool, cert: str | None
) -> list[IndexFile]:
    """The files of `project` at one index URL (`index`: the project page below it) or one
    find-links location (a page or a directory, holding many projects)."""
    if "://" not in location:
        return _local(project, Path(location).expanduser())
    if index:
        location = location.rstrip("/") + f"/{canonicalize_name(project)}/"
    if location.startswith("file:"):
        path = urllib.request.url2pathname(urllib.parse.urlsplit(location).path)
        return _local(project, Path(path))
    return _remote(project, location, cert)


def read_project(project: str, config: PipIndex) -> tuple[list[IndexFile], list[str]]:
    """Every file of `project` at every location of `config` (first location wins a file
    name), and one line per location that could not be read."""
    files: dict[str, IndexFile] = {}
    problems: list[str] = []
    locations = [(u, True) for u in config.index_urls] + [(u, False) for u in config.find_links]
    for location, is_index in locations:
        try:
            found = read_location(project, location, index=is_index, cert=config.cert)
        except READ_ERRORS as exc:
            problems.append(f"cannot read {redact(location)}: {_reason(exc)}")
            continue
        for file in found:
            files.setdefault(file.filename, file)
    return list(files.values()), problems


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        return str(exc.reason)
    return str(exc)
