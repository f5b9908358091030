"""A package index on 127.0.0.1 serving distributions we build from the fixture trees (the
shapes of SGLang 0.5.8 and FlashInfer 0.6.1, written by us): PEP 503 HTML pages, or PEP 691
JSON when asked, with the sha256 of each file. Lets the release cache and `matrix` run offline."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import socket
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from trees import FLASHINFER_FILES, SGLANG_FILES, VLLM_FILES

FILES = {"sglang": SGLANG_FILES, "flashinfer-python": FLASHINFER_FILES, "vllm": VLLM_FILES}
DIST = {"sglang": "sglang", "flashinfer-python": "flashinfer_python", "vllm": "vllm"}


def wheel_bytes(project: str, version: str, files: dict[str, str]) -> bytes:
    dist = DIST[project]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for rel, text in files.items():
            zf.writestr(rel, text)
        info = f"{dist}-{version}.dist-info"
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        if project == "vllm":  # its sources are kept member by member, each held to RECORD
            rows = []
            for item in zf.infolist():
                digest = base64.urlsafe_b64encode(hashlib.sha256(zf.read(item)).digest())
                rows.append(f"{item.filename},sha256={digest.rstrip(b'=').decode()},{item.file_size}")
            zf.writestr(f"{info}/RECORD", "\n".join([*rows, f"{info}/RECORD,,"]) + "\n")
    return buf.getvalue()


def sdist_bytes(project: str, version: str, files: dict[str, str]) -> bytes:
    top = f"{DIST[project]}-{version}"
    members = {**files, "PKG-INFO": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for rel, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@dataclass
class FakeIndex:
    root: Path
    url: str = ""  # http://127.0.0.1:PORT/simple
    requests: list[str] = field(default_factory=list)
    delay_s: dict[str, float] = field(default_factory=dict)  # file name -> seconds before answering

    def add(self, project: str, version: str, *, sdist: bool = False, yanked: bool = False,
            files: dict[str, str] | None = None, serve_instead: bytes | None = None) -> Path:
        """Publish one release of `project` (files: the fixture tree of its kind);
        `serve_instead`: what a forging mirror serves under the genuine file's sha256."""
        files = files if files is not None else FILES[project]
        data = sdist_bytes(project, version, files) if sdist else wheel_bytes(project, version, files)
        genuine = hashlib.sha256(data).hexdigest()
        data = data if serve_instead is None else serve_instead
        name = f"{DIST[project]}-{version}" + (".tar.gz" if sdist else "-py3-none-any.whl")
        path = self.root / "files" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        meta = self.root / "meta" / f"{project}.json"
        entries = json.loads(meta.read_text()) if meta.exists() else []
        entries.append({"filename": name, "yanked": yanked, "sha256": genuine})
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps(entries))
        return path

    def page(self, project: str, as_json: bool) -> tuple[bytes, str]:
        meta = self.root / "meta" / f"{project}.json"
        entries = json.loads(meta.read_text()) if meta.exists() else []
        if as_json:
            doc = {"meta": {"api-version": "1.0"}, "name": project, "files": [
                {"filename": e["filename"], "url": f"../../files/{e['filename']}",
                 "hashes": {"sha256": e["sha256"]}, "yanked": e["yanked"]} for e in entries]}
            return json.dumps(doc).encode(), "application/vnd.pypi.simple.v1+json"
        links = "".join(
            f'<a href="../../files/{e["filename"]}#sha256={e["sha256"]}"'
            f'{" data-yanked" if e["yanked"] else ""}>{e["filename"]}</a>\n' for e in entries)
        return f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode(), "text/html"


@contextmanager
def serve(root: Path, *, json_pages: bool = False, ranges: bool = False) -> Iterator[FakeIndex]:
    """The index at `root`; `ranges`: files answer HTTP range requests (206), as PyPI's
    file host does."""
    index = FakeIndex(root)

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self) -> None:
            index.requests.append(self.path)
            parts = [p for p in self.path.split("/") if p]
            if len(parts) == 2 and parts[0] == "simple":
                meta = root / "meta" / f"{parts[1]}.json"
                if not meta.exists():
                    self.send_error(404)
                    return
                want_json = json_pages and "json" in self.headers.get("Accept", "")
                body, kind = index.page(parts[1], want_json)
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            time.sleep(index.delay_s.get(parts[-1] if parts else "", 0.0))
            asked = self.headers.get("Range", "")
            path = root / "/".join(parts)
            if ranges and asked.startswith("bytes=") and path.is_file():
                data = path.read_bytes()
                first, _, last = asked[len("bytes="):].partition("-")
                start = len(data) - int(last) if not first else int(first)
                end = len(data) - 1 if not first or not last else min(int(last), len(data) - 1)
                start = max(start, 0)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.send_header("Content-Length", str(end - start + 1))
                self.end_headers()
                self.wfile.write(data[start:end + 1])
                return
            super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    index.url = f"http://127.0.0.1:{server.server_address[1]}/simple"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield index
    finally:
        server.shutdown()
        server.server_close()


def closed_port_url() -> str:
    """An index URL nothing listens on: connection refused, as offline."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/simple"


def pip_env(index_url: str | None, cache: Path, config_file: str = os.devnull) -> dict[str, str]:
    """This environment with pip configured by `config_file` and `index_url` alone (never the
    machine's own pip config or PIP_* variables) and the release cache at `cache`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = config_file
    if index_url:
        env["PIP_INDEX_URL"] = index_url
    env["SM120PATCH_CACHE"] = str(cache)
    return env
