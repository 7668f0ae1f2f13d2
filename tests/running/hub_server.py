"""The Hugging Face Hub, as far as huggingface_hub's snapshot_download uses it, served from memory by a real HTTP
server on 127.0.0.1: point HF_ENDPOINT at `FakeHub.url` (in a subprocess: huggingface_hub reads it at import) and
the download code runs unchanged. The server records what was asked of it, so a test can say which files were
downloaded.

The routes are the ones huggingface_hub (2.x) calls for a download: the model's revision API (`sha`, `siblings`),
the recursive tree listing, and HEAD/GET of `/{repo}/resolve/{revision}/{file}` with the headers it checks
(X-Repo-Commit, ETag, Content-Length). No LFS redirects, no Xet: every file is served as a regular git file.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tests.running.hub_cache import COMMIT


def git_oid(data: bytes) -> str:
    """A file's git blob id, which the Hub gives as its `oid` and, for a file not in LFS, its ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Repositories (`add`) served by a real server until `close`; `downloads(repo_id)` lists the files it sent."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in the order served
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo_id: str, files: dict[str, bytes] | Path, commit: str = COMMIT) -> None:
        """Serve `files` (name -> bytes, or every file of a directory) as repo_id at `commit`, its main branch."""
        if isinstance(files, Path):
            files = {p.relative_to(files).as_posix(): p.read_bytes() for p in sorted(files.rglob("*")) if p.is_file()}
        self.repos[repo_id], self.commits[repo_id] = dict(files), commit

    def downloads(self, repo_id: str) -> list[str]:
        """The files of repo_id sent with GET (a download, not a HEAD for metadata), in the order asked."""
        prefix = f"/{repo_id}/resolve/"
        with self._lock:
            return [path.removeprefix(prefix).split("/", 1)[1] for method, path in self.requests
                    if method == "GET" and path.startswith(prefix)]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))


def _handler(hub: FakeHub) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.record(self.command, path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                self._api("/".join(parts[2:4]), parts[4], parts[5], body)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            else:
                self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, body)

        def _repo(self, repo_id: str, revision: str, body: bool) -> tuple[dict[str, bytes], str] | None:
            """The repository's files and commit at `revision`; None once a 404 is sent."""
            files = hub.repos.get(repo_id)
            if files is None:
                return self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, body)
            if revision not in ("main", hub.commits[repo_id]):
                return self._send(404, b"", {"X-Error-Code": "RevisionNotFound"}, body)
            return files, hub.commits[repo_id]

        def _api(self, repo_id: str, route: str, revision: str, body: bool) -> None:
            if (found := self._repo(repo_id, revision, body)) is None:
                return
            files, commit = found
            if route == "revision":  # what model_info answers: the commit the revision is at, and its files
                answer = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                          "siblings": [{"rfilename": name} for name in files]}
            else:  # the recursive tree listing, in one page (no Link header: no next page)
                answer = [{"type": "file", "path": name, "size": len(data), "oid": git_oid(data)}
                          for name, data in files.items()]
            self._send(200, json.dumps(answer).encode(), {"Content-Type": "application/json"}, body)

        def _file(self, repo_id: str, revision: str, name: str, body: bool) -> None:
            if (found := self._repo(repo_id, revision, body)) is None:
                return
            files, commit = found
            if name not in files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, body)
            data = files[name]
            self._send(200, data, {"X-Repo-Commit": commit, "ETag": f'"{git_oid(data)}"'}, body)

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    return Handler
