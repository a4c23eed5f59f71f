"""A Hugging Face Hub on 127.0.0.1, for the tests: the endpoints huggingface_hub's upload and download code calls.

The tests point ``HF_ENDPOINT`` at :class:`HubServer` (in a subprocess: huggingface_hub reads it at import), and
huggingface_hub's and transformers' own code run unchanged against it: ``push_to_hub``, ``upload_folder``,
``from_pretrained`` by repo id, ``ModelCard.load``. It answers as the real Hub does, as far as those clients read
the answers:

* ``POST /api/repos/create`` (409 when the repo exists: the clients' ``exist_ok`` relies on it), ``GET
  /api/whoami-v2``, ``POST /api/validate-yaml`` (a README's front matter);
* ``POST /api/models/{repo}/preupload/{revision}``: every file is a ``"regular"`` upload (its bytes travel in the
  commit itself, so no LFS or Xet storage is involved), with the blob id of the file already there, which the client
  compares to skip unchanged files;
* ``POST /api/models/{repo}/commit/{revision}``: the NDJSON commit (header, ``file`` with base64 content,
  ``deletedFile``, ``deletedFolder``); each commit gets a new 40-hex id and moves its branch;
  ``POST /api/models/{repo}/branch/{branch}``;
* ``GET /api/models/{repo}``, ``.../revision/{rev}`` (``sha``, ``siblings``), ``.../tree/{rev}[/{path}]``;
* ``GET``/``HEAD /{repo}/resolve/{rev}/{path}`` by branch or commit id, with ``X-Repo-Commit``, ``ETag`` (the
  git blob id, as for a regular file) and ``Content-Length``.

Errors carry ``X-Error-Code`` / ``X-Error-Message`` as the Hub's do, which is how huggingface_hub picks its
exception: ``RepoNotFound`` (404; 401 when the caller sent no valid token, as the Hub answers for a private repo it
will not reveal), ``RevisionNotFound``, ``EntryNotFound`` (404). One token is valid, :data:`TOKEN`, of the user
:data:`USER` with write access. A request for anything else is answered 501 naming it, printed to stderr and kept in
:attr:`HubServer.unknown_requests`: a client call this server does not know fails loudly, and the fixture that
runs the server fails the test.

Standard library only: a ``ThreadingHTTPServer`` in a daemon thread.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import re
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = "hf_test_token"
USER = "someone"
ORGS = ("hf-neural-attn-tests",)
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"  # what the Hub puts in a new repo


def git_blob_id(content: bytes) -> str:
    """The git object id of a file's content: the ETag the Hub gives a regular file, and its tree ``oid``."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Repo:
    """A model repo: commits (id -> {path: bytes}), branches (name -> commit id)."""

    repo_id: str
    private: bool
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        """The commit id a branch name or a full commit id names, or None."""
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None


class HubError(Exception):
    """An error answer: status, the Hub's ``X-Error-Code`` and its message, extra headers and JSON fields."""

    def __init__(self, status: int, code: str | None, message: str, headers=None, **fields):
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.fields = status, code, message, headers or {}, fields


class HubServer:
    """The server and its state: :meth:`start`, then point ``HF_ENDPOINT`` at :attr:`url`; :meth:`stop` at the end."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.unknown_requests: list[str] = []
        self.requests: list[str] = []  # "METHOD /path", every request, for tests that check what was asked
        self._lock = threading.RLock()
        self._commit_counter = itertools.count(1)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def client_env(self, home: os.PathLike, **extra: str) -> dict[str, str]:
        """The environment of a subprocess whose Hub clients talk to this server: its own Hub home and cache under
        ``home``, no token unless ``extra`` gives ``HF_TOKEN``, no Xet (every file is a regular upload here), the
        repository and tests/ on the import path, one thread."""
        tests = os.path.dirname(os.path.abspath(__file__))
        env = {name: value for name, value in os.environ.items() if not name.startswith(("HF_", "TRANSFORMERS_"))}
        env.update(
            HF_ENDPOINT=self.url,
            HF_HUB_OFFLINE="0",
            HF_HOME=str(home),
            HF_HUB_CACHE=os.path.join(home, "hub"),
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]),
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
        )
        env.update(extra)
        return env

    # ------------------------------------------------------------------------------------ reading, for the tests

    def download(self, repo_id: str, path: str, revision: str = "main", token: str | None = TOKEN) -> bytes:
        """A file as a client downloads it: ``GET /{repo}/resolve/{revision}/{path}`` over HTTP."""
        request = urllib.request.Request(f"{self.url}/{repo_id}/resolve/{revision}/{path}")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The files of ``repo_id`` at ``revision`` (raises KeyError for an unknown repo or revision)."""
        with self._lock:
            repo = self.repos[repo_id]
            return dict(repo.commits[repo.resolve(revision) or revision])

    def commit_ids(self, repo_id: str) -> list[str]:
        """The repo's commit ids, oldest first (the first one is the repo's creation)."""
        with self._lock:
            return list(self.repos[repo_id].commits)

    # ------------------------------------------------------------------------------------------ the endpoints

    def handle(self, method: str, path: str, query: dict[str, list[str]], headers, body: bytes):
        """Answer one request: ``(status, headers, body)``; :class:`HubError` for the Hub's error answers."""
        token = _bearer_token(headers)
        if token is not None and token != TOKEN:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        authorized = token == TOKEN
        with self._lock:
            if method == "GET" and path == "/api/whoami-v2":
                return self._whoami(authorized)
            if method == "POST" and path == "/api/repos/create":
                return self._create_repo(authorized, json.loads(body or b"{}"))
            if method == "POST" and path == "/api/validate-yaml":
                return self._validate_yaml(json.loads(body or b"{}"))
            if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/([^/]+)", path):
                repo_id, action, revision = match.group(1), match.group(2), unquote(match.group(3))
                repo = self._readable_repo(repo_id, authorized)
                if method == "POST" and action == "preupload":
                    return self._preupload(repo, revision, json.loads(body))
                if method == "POST" and action == "commit":
                    return self._commit(repo, revision, body)
                if method == "POST" and action == "branch":
                    return self._create_branch(repo, revision, json.loads(body or b"{}"))
            if method == "GET" and (match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)):
                repo = self._readable_repo(match.group(1), authorized)
                return self._model_info(repo, unquote(match.group(2) or "main"))
            if method == "GET" and (match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)):
                repo = self._readable_repo(match.group(1), authorized)
                recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                return self._tree(repo, unquote(match.group(2)), unquote(match.group(3) or ""), recursive)
            if method in ("GET", "HEAD") and (match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)):
                repo = self._readable_repo(match.group(1), authorized)
                return self._resolve(repo, unquote(match.group(2)), unquote(match.group(3)), headers)
        request = f"{method} {path}"
        self.unknown_requests.append(request)
        print(f"hub_server: no such endpoint here: {request}", file=sys.stderr, flush=True)
        raise HubError(501, None, f"tests/hub_server.py does not answer {request}")

    def _whoami(self, authorized: bool):
        if not authorized:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        orgs = [{"type": "org", "name": org} for org in ORGS]
        auth = {"type": "access_token", "accessToken": {"displayName": "tests", "role": "write"}}
        return _json(200, {"type": "user", "name": USER, "fullname": "Test User", "orgs": orgs, "auth": auth})

    def _create_repo(self, authorized: bool, payload: dict):
        if not authorized:
            raise HubError(401, None, "You must be authenticated to create a repository")
        if payload.get("type", "model") != "model":
            raise HubError(400, None, "tests/hub_server.py keeps model repos only")
        namespace = payload.get("organization") or USER
        if namespace not in (USER, *ORGS):
            raise HubError(403, None, f"You don't have the rights to create a model under the namespace {namespace!r}")
        repo_id = f"{namespace}/{payload['name']}"
        url = f"{self.url}/{repo_id}"
        if repo_id in self.repos:
            # The Hub's 409 carries the repo's url: create_repo(exist_ok=True) returns it.
            raise HubError(409, None, "You already created this model repo", url=url)
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo = self.repos[repo_id] = Repo(repo_id, private=private)
        first = self._new_commit_id(repo_id, {})
        repo.commits[first] = {".gitattributes": GITATTRIBUTES}
        repo.branches["main"] = first
        return _json(200, {"url": url, "name": repo_id, "id": first})

    @staticmethod
    def _validate_yaml(payload: dict):
        """The Hub checks a README's YAML block before a commit; the stdlib has no YAML parser, so this checks the
        block's delimiters only (huggingface_hub's ModelCard checks the YAML itself when it writes the card)."""
        content = payload.get("content", "")
        if content.startswith("---") and not re.match(r"---\r?\n.*?\r?\n---\r?\n", content, flags=re.DOTALL):
            return _json(400, {"errors": [{"message": "the YAML block is not closed by a '---' line"}]})
        return _json(200, {"errors": [], "warnings": []})

    def _readable_repo(self, repo_id: str, authorized: bool) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not authorized):
            # The Hub does not say whether a repo it will not show exists: without a valid token, 401 either way.
            raise HubError(401 if not authorized else 404, "RepoNotFound", "Repository not found")
        return repo

    def _commit_of(self, repo: Repo, revision: str) -> str:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def _preupload(self, repo: Repo, revision: str, payload: dict):
        current = repo.commits[self._commit_of(repo, revision)]
        files = [
            {
                "path": entry["path"],
                "uploadMode": "regular",  # never LFS: the content travels in the commit
                "shouldIgnore": False,
                "oid": git_blob_id(current[entry["path"]]) if entry["path"] in current else None,
            }
            for entry in payload.get("files", [])
        ]
        return _json(200, {"files": files, "commitOid": repo.branches.get(revision, revision)})

    def _commit(self, repo: Repo, revision: str, body: bytes):
        parent = self._commit_of(repo, revision)
        if revision not in repo.branches:
            raise HubError(400, None, f"Cannot commit to {revision!r}: commits go to a branch")
        files = dict(repo.commits[parent])
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                expected = value.get("parentCommit")
                if expected and expected != parent:
                    raise HubError(412, None, f"Parent commit {expected} is not the head of {revision!r} ({parent})")
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, None, f"file {value.get('path')!r}: expected base64 content")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise HubError(404, "EntryNotFound", f"A file with this name doesn't exist: {value['path']}")
                del files[value["path"]]
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {path: content for path, content in files.items() if not path.startswith(prefix)}
            else:  # lfsFile and the like: this server told the client every file is regular
                raise HubError(400, None, f"tests/hub_server.py takes regular files only, got a {key!r} line")
        commit = self._new_commit_id(repo.repo_id, files)
        repo.commits[commit] = files
        repo.branches[revision] = commit
        url = f"{self.url}/{repo.repo_id}/commit/{commit}"
        return _json(200, {"success": True, "commitOid": commit, "commitUrl": url, "pullRequestUrl": None})

    def _create_branch(self, repo: Repo, branch: str, payload: dict):
        if branch in repo.branches:
            raise HubError(409, None, f"Reference {branch!r} already exists")
        repo.branches[branch] = self._commit_of(repo, payload.get("startingPoint") or "main")
        return _json(200, {})

    def _model_info(self, repo: Repo, revision: str):
        commit = self._commit_of(repo, revision)
        files = repo.commits[commit]
        return _json(
            200,
            {
                "_id": commit[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": commit,
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "tags": [],
                "downloads": 0,
                "likes": 0,
                "siblings": [{"rfilename": path} for path in sorted(files)],
            },
        )

    def _tree(self, repo: Repo, revision: str, folder: str, recursive: bool):
        files = repo.commits[self._commit_of(repo, revision)]
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        entries, folders = [], set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/", 1)[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                folders.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
            content = files[path]
            entries.append({"type": "file", "oid": git_blob_id(content), "size": len(content), "path": path})
        if prefix and not entries and not folders:
            raise HubError(404, "EntryNotFound", f"{folder} does not exist on {revision!r}")
        entries += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": path} for path in sorted(folders)]
        return _json(200, entries)

    def _resolve(self, repo: Repo, revision: str, path: str, headers):
        commit = self._commit_of(repo, revision)
        files = repo.commits[commit]
        if path not in files:
            raise HubError(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit})
        content = files[path]
        answer_headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{git_blob_id(content)}"',
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
        }
        status = 200
        if match := re.fullmatch(r"bytes=(\d+)-(\d*)", headers.get("Range", "")):
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) else len(content) - 1
            answer_headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
            content, status = content[start : end + 1], 206
        return status, answer_headers, content

    def _new_commit_id(self, repo_id: str, files: dict[str, bytes]) -> str:
        digest = hashlib.sha1(f"{repo_id}:{next(self._commit_counter)}".encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + git_blob_id(files[path]).encode())
        return digest.hexdigest()


def _bearer_token(headers) -> str | None:
    value = headers.get("Authorization") or ""
    return value[len("Bearer ") :].strip() if value.startswith("Bearer ") else None


def _json(status: int, payload) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(payload).encode()


def _handler_for(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the clients' connection pools expect

        def _answer(self) -> None:
            split = urlsplit(self.path)
            body = self._read_body()
            hub.requests.append(f"{self.command} {split.path}")
            try:
                status, headers, payload = hub.handle(
                    self.command, split.path, parse_qs(split.query), self.headers, body
                )
            except HubError as error:
                status, payload = error.status, json.dumps({"error": error.message, **error.fields}).encode()
                headers = {"Content-Type": "application/json", "X-Error-Message": error.message, **error.headers}
                if error.code:
                    headers["X-Error-Code"] = error.code
            except Exception as error:  # a bug here: say so to the client and on stderr
                print(f"hub_server: {self.command} {split.path} failed: {error!r}", file=sys.stderr, flush=True)
                status, headers, payload = 500, {"Content-Type": "text/plain"}, repr(error).encode()
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, format, *args):  # the tests' output stays quiet; unknown endpoints still print
            pass

    return Handler
