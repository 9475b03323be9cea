"""A small Hugging Face Hub-compatible HTTP server for tests (127.0.0.1 only, in memory).

It implements the part of the Hub API that the real `huggingface_hub` client (2.x) calls for
`create_repo`, `create_branch`, `upload_folder` / `create_commit` (regular, non-LFS files),
`repo_info` / `model_info`, `list_repo_tree`, `hf_hub_download` and `snapshot_download`:

- POST /api/repos/create                              -> 200 {"url"} | 409 when it exists
- POST /api/validate-yaml                              -> 200, or 400 with errors when the card's YAML is invalid
- POST /api/models/{repo}/preupload/{rev}              -> every file "regular" (base64 in the commit), with its oid
- POST /api/models/{repo}/commit/{rev}                 -> applies the NDJSON commit, 200 {"commitUrl", "commitOid"}
- POST /api/models/{repo}/branch/{branch}              -> branch from the head of main (409 when it exists)
- GET  /api/models/{repo}[/revision/{rev}]             -> {"id", "sha", "private", "siblings"}
- GET  /api/models/{repo}/tree/{rev}[/{path}]          -> [{"type": "file", "path", "size", "oid"}]
- HEAD/GET /{repo}/resolve/{rev}/{path}                -> bytes, with X-Repo-Commit and ETag (git blob sha1)

Errors carry the `X-Error-Code` header the client maps to its exceptions (RepoNotFound, RevisionNotFound,
EntryNotFound). Writes need a `Bearer` token; reads of private repos too. The server records every request's
method, path and Authorization header in `requests` so tests can assert what the client sent; it writes nothing
to disk. Usage: `with HubServer() as hub: os.environ["HF_ENDPOINT"] = hub.url`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", re.DOTALL)


def git_blob_sha1(content: bytes) -> str:
    """The git object id of a blob, which the Hub uses as the oid and ETag of regular files."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class _Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit oid -> {path: content}

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    authorization: str | None


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, **extra: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


class HubServer:
    """An in-memory Hub on 127.0.0.1 at a free port; a context manager that starts and stops it."""

    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._commit_counter = 0
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # ---- state changes (called with the lock held) ----
    def _new_commit(self, repo: _Repo, parent: str | None, files: dict[str, bytes]) -> str:
        self._commit_counter += 1
        oid = hashlib.sha1(f"{parent}:{self._commit_counter}".encode()).hexdigest()
        repo.commits[oid] = files
        return oid

    def _repo(self, repo_id: str, authorization: str | None) -> _Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not authorization):
            raise _HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
        return repo

    def _revision(self, repo_id: str, repo: _Repo, revision: str) -> str:
        oid = repo.resolve(revision)
        if oid is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision} for {repo_id}")
        return oid

    # ---- request handling ----
    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
                pass  # tests read `hub.requests` instead of stderr noise

            def do_HEAD(self) -> None:
                self._dispatch("HEAD")

            def do_GET(self) -> None:
                self._dispatch("GET")

            def do_POST(self) -> None:
                self._dispatch("POST")

            def _dispatch(self, method: str) -> None:
                split = urlsplit(self.path)
                # Split before unquoting: a revision like "a/b" travels as one %2F-quoted segment.
                parts = [unquote(p) for p in split.path.split("/")[1:]]
                query = parse_qs(split.query)
                auth = self.headers.get("Authorization")
                with hub._lock:
                    hub.requests.append(RecordedRequest(method, split.path, auth))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
                try:
                    status, headers, payload = hub._route(method, parts, query, body, auth)
                except _HubError as err:
                    status, payload = err.status, json.dumps({"error": err.message, **err.extra}).encode()
                    headers = {"Content-Type": "application/json", "X-Error-Message": err.message}
                    if err.code:
                        headers["X-Error-Code"] = err.code
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(payload)

        return Handler

    def _route(
        self, method: str, parts: list[str], query: dict[str, list[str]], body: bytes, auth: str | None
    ) -> tuple[int, dict[str, str], bytes]:
        if (method == "POST" and auth is None) or (auth is not None and not auth.startswith("Bearer ")):
            raise _HubError(401, None, "Invalid credentials in Authorization header")
        with self._lock:
            if parts[:2] == ["api", "repos"] and parts[2:] == ["create"] and method == "POST":
                return self._create_repo(json.loads(body))
            if parts[:2] == ["api", "validate-yaml"] and method == "POST":
                return self._validate_yaml(json.loads(body))
            if len(parts) >= 4 and parts[:2] == ["api", "models"]:
                repo_id = f"{parts[2]}/{parts[3]}"
                return self._api_models(method, repo_id, parts[4:], query, body, auth)
            if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
                return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), auth)
        raise _HubError(404, None, f"Unsupported route {method} /{'/'.join(parts)}")

    def _create_repo(self, payload: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        if repo_id in self.repos:
            # Like the Hub, a 409 still names the repo's url: create_repo(exist_ok=True) returns it.
            raise _HubError(409, None, "You already created this model repo", url=f"{self.url}/{repo_id}")
        repo = _Repo(private=payload.get("visibility") == "private" or bool(payload.get("private")))
        repo.branches["main"] = self._new_commit(repo, None, {})
        self.repos[repo_id] = repo
        return 200, {"Content-Type": "application/json"}, json.dumps({"url": f"{self.url}/{repo_id}"}).encode()

    def _validate_yaml(self, payload: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        match = _FRONT_MATTER.match(payload["content"])
        errors = []
        if match is None:
            errors.append({"message": "README.md has no YAML front matter"})
        else:
            try:
                if not isinstance(yaml.safe_load(match.group(1)), dict):
                    errors.append({"message": "YAML front matter is not a mapping"})
            except yaml.YAMLError as err:
                errors.append({"message": f"invalid YAML: {err}"})
        return (
            (400 if errors else 200),
            {"Content-Type": "application/json"},
            json.dumps({"errors": errors, "warnings": []}).encode(),
        )

    def _api_models(
        self, method: str, repo_id: str, rest: list[str], query: dict[str, list[str]], body: bytes, auth: str | None
    ) -> tuple[int, dict[str, str], bytes]:
        repo = self._repo(repo_id, auth)
        json_headers = {"Content-Type": "application/json"}
        if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
            files = self._files(repo_id, repo, rest[1])
            answer = [
                {
                    "path": f["path"],
                    "uploadMode": "regular",
                    "shouldIgnore": False,
                    "oid": git_blob_sha1(files[f["path"]]) if f["path"] in files else None,
                }
                for f in json.loads(body)["files"]
            ]
            return 200, json_headers, json.dumps({"files": answer}).encode()
        if method == "POST" and len(rest) == 2 and rest[0] == "commit":
            return self._commit(repo_id, repo, rest[1], body)
        if method == "POST" and len(rest) == 2 and rest[0] == "branch":
            if rest[1] in repo.branches:
                raise _HubError(409, None, f"Branch {rest[1]} already exists")
            payload = json.loads(body or b"{}")
            repo.branches[rest[1]] = self._revision(repo_id, repo, payload.get("startingPoint") or "main")
            return 200, json_headers, b"{}"
        if method == "GET" and (not rest or (len(rest) == 2 and rest[0] == "revision")):
            sha = self._revision(repo_id, repo, rest[1] if rest else "main")
            info = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": sha,
                "private": repo.private,
                "siblings": [{"rfilename": p} for p in sorted(repo.commits[sha])],
            }
            return 200, json_headers, json.dumps(info).encode()
        if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
            files = self._files(repo_id, repo, rest[1])
            prefix = "/".join(rest[2:])
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            entries = []
            for path in sorted(files):
                if prefix and not path.startswith(prefix + "/"):
                    continue
                relative = path[len(prefix) + 1 :] if prefix else path
                if not recursive and "/" in relative:
                    continue  # sub-folder entries are not needed by the client paths this server serves
                entries.append(
                    {"type": "file", "path": path, "size": len(files[path]), "oid": git_blob_sha1(files[path])}
                )
            return 200, json_headers, json.dumps(entries).encode()
        raise _HubError(404, None, f"Unsupported route {method} /api/models/{repo_id}/{'/'.join(rest)}")

    def _files(self, repo_id: str, repo: _Repo, revision: str) -> dict[str, bytes]:
        return repo.commits[self._revision(repo_id, repo, revision)]

    def _commit(self, repo_id: str, repo: _Repo, revision: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        if revision not in repo.branches:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        parent = repo.branches[revision]
        files = dict(repo.commits[parent])
        for line in body.splitlines():
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "file":
                if value.get("encoding") != "base64":
                    raise _HubError(400, None, f"unsupported encoding {value.get('encoding')!r}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "deletedFile":
                files.pop(value["path"], None)
            elif item["key"] != "header":
                raise _HubError(400, None, f"this test Hub only stores regular files, got {item['key']!r}")
        oid = self._new_commit(repo, parent, files)
        repo.branches[revision] = oid
        answer = {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid}
        return 200, {"Content-Type": "application/json"}, json.dumps(answer).encode()

    def _resolve(self, repo_id: str, revision: str, path: str, auth: str | None) -> tuple[int, dict[str, str], bytes]:
        repo = self._repo(repo_id, auth)
        sha = self._revision(repo_id, repo, revision)
        files = repo.commits[sha]
        if path not in files:
            raise _HubError(404, "EntryNotFound", f"{path} does not exist at {revision}")
        content = files[path]
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{git_blob_sha1(content)}"',
            "Content-Type": "application/octet-stream",
        }
        return 200, headers, content
