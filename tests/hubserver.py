"""A fake Hugging Face Hub for tests: an in-process HTTP server on 127.0.0.1 (ephemeral port)
that speaks the part of the Hub API the real `huggingface_hub` client uses to create a repo,
commit files (regular and LFS, basic and multipart) and read them back.

Implemented (model repos only):

    POST /api/repos/create                            create_repo (409 when it exists)
    POST /api/validate-yaml                           README.md metadata check in create_commit
    GET  /api/models/{repo}[/revision/{rev}]          model_info / repo_info (siblings, sha)
    GET  /api/models/{repo}/tree/{rev}[/{path}]       list_repo_tree / list_repo_files
    POST /api/models/{repo}/preupload/{rev}           upload mode (regular/lfs) + remote oid
    POST /{repo}.git/info/lfs/objects/batch           LFS batch: basic or multipart actions
    PUT  /_lfs/{oid}  PUT /_lfs/{oid}/part/{n}        LFS object / part upload ("S3", no auth)
    POST /_lfs/{oid}/complete  POST /_lfs/{oid}/verify   multipart completion, LFS verify
    POST /api/models/{repo}/commit/{rev}              ndjson commit: file, lfsFile, deletedFile,
                                                      deletedFolder; parentCommit checked (412)
    HEAD/GET /{repo}/resolve/{rev}/{path}             hf_hub_download (ETag, X-Repo-Commit,
                                                      X-Linked-Etag/-Size, Range)
    GET  /api/whoami-v2                               whoami
    GET  /api/agent-harnesses                         the client's user-agent registry (empty)

Not implemented (any other route answers 501, so a test that strays is loud): Xet storage
(CAS, /xet-*-token; run the client with HF_HUB_DISABLE_XET=1), datasets/spaces/buckets,
branches, tags and pull requests (revisions are `main` or a commit sha), repo delete/move/
settings/visibility changes, gated repos, .gitignore handling, commit copies
(CommitOperationCopy), pagination (every listing is one page), rate limits.

Auth: write routes need `Authorization: Bearer <token>` with the server's token; a private
repo needs it for reads too. `fail(...)` injects errors (e.g. a 503 on the commit route) and
`echo_auth_in_errors` makes error bodies quote the Authorization header, to test that the
client side never repeats a token.
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5",
                "*.msgpack", "*.onnx", "*.model", "*.zip", "*.npz", "*.parquet")
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS)
LFS_SIZE = 10 * 1024 * 1024  # the Hub's threshold for text files
_REPO = r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
            f"size {size}\n").encode()


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def oid(self) -> str:
        """The git blob id: of the content, or of the LFS pointer for LFS files."""
        if self.lfs:
            return git_oid(lfs_pointer(self.sha256, len(self.data)))
        return git_oid(self.data)

    def entry(self, path: str) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "file", "oid": self.oid, "size": len(self.data),
                               "path": path}
        if self.lfs:
            out["lfs"] = {"oid": self.sha256, "size": len(self.data),
                          "pointerSize": len(lfs_pointer(self.sha256, len(self.data)))}
        return out


@dataclass
class Commit:
    oid: str
    title: str
    description: str
    parent: str | None
    files: dict[str, Blob]


@dataclass
class Repo:
    id: str
    private: bool
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> Commit:
        return self.commits[-1]

    def at(self, rev: str) -> Commit | None:
        if rev == "main":
            return self.head
        return next((c for c in self.commits if c.oid == rev), None)


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    times: int
    after: bool  # True: do the work, then answer with the error (a lost response)


@dataclass
class Hold:
    """A request held open: `arrived` is set when it reaches the server, which then waits
    for `release`; with `lose`, the request is then dropped without doing its work."""

    method: str
    path: re.Pattern[str]
    lose: bool
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.extra = extra or {}


class FakeHub:
    """Start with `with FakeHub(token=...) as hub:`; `hub.url` is the endpoint."""

    def __init__(self, token: str, user: str = "tester", orgs: tuple[str, ...] = ("test-org",),
                 multipart_threshold: int = 8 * 1024 * 1024,
                 multipart_chunk: int = 4 * 1024 * 1024) -> None:
        self.token, self.user, self.orgs = token, user, orgs
        self.multipart_threshold, self.multipart_chunk = multipart_threshold, multipart_chunk
        self.repos: dict[str, Repo] = {}
        self.objects: dict[str, bytes] = {}  # LFS store: sha256 → content
        self.parts: dict[str, dict[int, bytes]] = {}
        self.requests: list[dict[str, Any]] = []  # every request: method, path, auth, status
        self.faults: list[Fault] = []
        self.holds: list[Hold] = []
        self.echo_auth_in_errors = False
        self.lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._counter = 0

    # --- lifecycle -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "start the server first"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- test helpers ----------------------------------------------------------------------
    def fail(self, method: str, path_regex: str, status: int = 503, times: int = 1,
             after: bool = False) -> None:
        """The next `times` requests matching method and path get `status`; with `after`,
        the request is carried out first and only its response is lost."""
        with self.lock:
            self.faults.append(Fault(method, re.compile(path_regex), status, times, after))

    def hold(self, method: str, path_regex: str, *, lose: bool = False) -> Hold:
        """Hold the next request matching method and path until `release` is set (a test
        kills the client meanwhile); `done` is set once the server has finished it."""
        h = Hold(method, re.compile(path_regex), lose)
        with self.lock:
            self.holds.append(h)
        return h

    def files(self, repo_id: str) -> dict[str, Blob]:
        return dict(self.repos[repo_id].head.files)

    def commits(self, repo_id: str) -> list[Commit]:
        return list(self.repos[repo_id].commits)

    def calls(self, method: str, path_regex: str) -> list[dict[str, Any]]:
        rx = re.compile(path_regex)
        return [r for r in self.requests if r["method"] == method and rx.search(r["path"])]

    # --- model ------------------------------------------------------------------------------
    def _new_oid(self, *parts: str) -> str:
        self._counter += 1
        return hashlib.sha1("\0".join([str(self._counter), *parts]).encode()).hexdigest()

    def _commit(self, repo: Repo, title: str, description: str, files: dict[str, Blob]) -> Commit:
        parent = repo.commits[-1].oid if repo.commits else None
        c = Commit(self._new_oid(repo.id, title), title, description, parent, files)
        repo.commits.append(c)
        return c

    def is_lfs(self, path: str, size: int, sample: bytes) -> bool:
        name = path.rsplit("/", 1)[-1]
        return (any(fnmatch.fnmatch(name, p) for p in LFS_PATTERNS) or size >= LFS_SIZE
                or b"\0" in sample)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"
    _mute = False
    _status = 0

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # --- plumbing ---------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _auth(self) -> str | None:
        h = self.headers.get("Authorization", "")
        return h[7:] if h.startswith("Bearer ") else None

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        if self._mute:  # the response of a request whose answer a fault "loses"
            return
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._status = status

    def _json(self, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(data).encode(), headers)

    def _error(self, err: HubError) -> None:
        msg = err.message
        if self.fake.echo_auth_in_errors:
            msg += f" (got Authorization: {self.headers.get('Authorization')})"
        headers = {"X-Error-Message": msg}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._json(err.status, {"error": msg, **err.extra}, headers)

    def _dispatch(self) -> None:
        fake = self.fake
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        self._status = 0
        body = self._body() if self.command in ("POST", "PUT") else b""
        hold = None
        with fake.lock:
            for h in fake.holds:
                if h.method == self.command and h.path.search(path):
                    fake.holds.remove(h)
                    hold = h
                    break
        try:
            if hold is not None:
                hold.arrived.set()
                hold.release.wait(600)
                if hold.lose:
                    raise HubError(500, "held request dropped before it was carried out")
            fault = None
            with fake.lock:
                for f in fake.faults:
                    if f.times > 0 and f.method == self.command and f.path.search(path):
                        f.times -= 1
                        fault = f
                        break
            if fault is not None and not fault.after:
                raise HubError(fault.status, f"injected failure {fault.status}")
            if fault is not None:
                self._route(path, query, body, send=False)
                raise HubError(fault.status, f"injected failure {fault.status} (after the work)")
            self._route(path, query, body)
        except HubError as err:
            self._error(err)
        finally:
            with fake.lock:
                fake.requests.append({"method": self.command, "path": path, "query": query,
                                      "auth": self._auth(), "status": self._status,
                                      "bytes": len(body)})
            if hold is not None:
                hold.done.set()

    def handle(self) -> None:
        # the client went away (a killed publish): there is nobody to answer
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            super().handle()

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _dispatch

    # --- auth -------------------------------------------------------------------------------
    def _require_write(self, namespace: str | None = None) -> None:
        token = self._auth()
        if token is None:
            raise HubError(401, "Authorization header is required")
        if token != self.fake.token:
            raise HubError(401, "Invalid credentials in Authorization header")
        if namespace is not None and namespace not in (self.fake.user, *self.fake.orgs):
            raise HubError(403, f"You don't have the rights to create a model under the "
                                f"namespace \"{namespace}\"")

    def _repo(self, repo_id: str, write: bool = False) -> Repo:
        repo = self.fake.repos.get(repo_id)
        if write:
            self._require_write(repo_id.split("/")[0])
        if repo is None or (repo.private and self._auth() != self.fake.token):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _commit_at(self, repo: Repo, rev: str) -> Commit:
        c = repo.at(unquote(rev))
        if c is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return c

    # --- routes -----------------------------------------------------------------------------
    def _route(self, path: str, query: dict[str, list[str]], body: bytes,
               send: bool = True) -> None:
        self._mute = not send
        try:
            self._route_to(path, query, body)
        finally:
            self._mute = False

    def _route_to(self, path: str, query: dict[str, list[str]], body: bytes) -> None:
        m = self.command, path
        routes: list[tuple[str, str, Any]] = [
            ("POST", r"^/api/repos/create$", self._create),
            ("POST", r"^/api/validate-yaml$", self._validate_yaml),
            ("GET", r"^/api/whoami-v2$", self._whoami),
            ("GET", r"^/api/agent-harnesses$", self._harnesses),
            ("GET", rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?$", self._tree),
            ("GET", rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$", self._info),
            ("POST", rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$", self._preupload),
            ("POST", rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$", self._commit),
            ("POST", rf"^/{_REPO}\.git/info/lfs/objects/batch$", self._batch),
            ("PUT", r"^/_lfs/(?P<oid>[0-9a-f]{64})$", self._put_object),
            ("PUT", r"^/_lfs/(?P<oid>[0-9a-f]{64})/part/(?P<n>\d+)$", self._put_part),
            ("POST", r"^/_lfs/(?P<oid>[0-9a-f]{64})/complete$", self._complete),
            ("POST", r"^/_lfs/(?P<oid>[0-9a-f]{64})/verify$", self._verify),
            ("HEAD", rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", self._resolve),
            ("GET", rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", self._resolve),
        ]
        for method, rx, handler in routes:
            match = re.match(rx, path)
            if method == m[0] and match:
                with self.fake.lock:
                    handler(match, query, body)
                return
        raise HubError(501, f"the fake Hub does not implement {self.command} {path}")

    def _create(self, _m: re.Match[str], _q: Any, body: bytes) -> None:
        req = json.loads(body)
        if req.get("type", "model") != "model":
            raise HubError(501, "the fake Hub only has model repos")
        namespace = req.get("organization") or self.fake.user
        self._require_write(namespace)
        repo_id = f"{namespace}/{req['name']}"
        if repo_id in self.fake.repos:
            # The Hub's 409 carries the url; create_repo(exist_ok=True) reads it.
            raise HubError(409, "You already created this model repo",
                           extra={"url": f"{self.fake.url}/{repo_id}"})
        private = req.get("visibility") == "private" or bool(req.get("private"))
        repo = Repo(repo_id, private)
        self.fake._commit(repo, "initial commit", "",
                          {".gitattributes": Blob(GITATTRIBUTES.encode(), False)})
        self.fake.repos[repo_id] = repo
        self._json(200, {"url": f"{self.fake.url}/{repo_id}", "name": repo_id})

    def _validate_yaml(self, _m: re.Match[str], _q: Any, body: bytes) -> None:
        from huggingface_hub import ModelCard

        content = json.loads(body)["content"]
        try:
            ModelCard(content, ignore_metadata_errors=False)
        except Exception as exc:
            self._json(400, {"errors": [{"message": str(exc)}], "warnings": []})
            return
        self._json(200, {"errors": [], "warnings": []})

    def _whoami(self, _m: re.Match[str], _q: Any, _b: bytes) -> None:
        self._require_write()
        self._json(200, {"type": "user", "name": self.fake.user,
                         "orgs": [{"name": o, "type": "org"} for o in self.fake.orgs],
                         "auth": {"type": "access_token",
                                  "accessToken": {"displayName": "test", "role": "write"}}})

    def _harnesses(self, _m: re.Match[str], _q: Any, _b: bytes) -> None:
        # the client fetches this registry once to label its user agent: an empty one
        self._json(200, {"standardEnvVars": [], "harnesses": {}})

    def _info(self, m: re.Match[str], _q: Any, _b: bytes) -> None:
        repo = self._repo(m["repo"])
        c = self._commit_at(repo, m["rev"] or "main")
        card: dict[str, Any] = {}
        if "README.md" in c.files:
            text = c.files["README.md"].data.decode()
            if text.startswith("---"):
                card = yaml.safe_load(text.split("---", 2)[1]) or {}
        siblings = [{"rfilename": p, "size": len(b.data), "blobId": b.oid,
                     **({"lfs": {"size": len(b.data), "sha256": b.sha256,
                                 "pointerSize": len(lfs_pointer(b.sha256, len(b.data)))}}
                        if b.lfs else {})}
                    for p, b in sorted(c.files.items())]
        self._json(200, {"id": repo.id, "modelId": repo.id, "author": repo.id.split("/")[0],
                         "sha": c.oid, "private": repo.private, "disabled": False,
                         "gated": False, "downloads": 0, "likes": 0, "tags": card.get("tags", []),
                         "library_name": card.get("library_name"), "cardData": card,
                         "siblings": siblings, "lastModified": "2026-01-01T00:00:00.000Z",
                         "createdAt": "2026-01-01T00:00:00.000Z"})

    def _tree(self, m: re.Match[str], q: dict[str, list[str]], _b: bytes) -> None:
        repo = self._repo(m["repo"])
        c = self._commit_at(repo, m["rev"])
        sub = (m["sub"] or "").strip("/")
        recursive = q.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{sub}/" if sub else ""
        entries: dict[str, dict[str, Any]] = {}
        for p, blob in sorted(c.files.items()):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):].split("/")
            for depth in range(1, len(rest)):
                d = prefix + "/".join(rest[:depth])
                if depth == 1 or recursive:
                    entries.setdefault(d, {"type": "directory", "oid": git_oid(d.encode()),
                                           "size": 0, "path": d})
            if len(rest) == 1 or recursive:
                entries[p] = blob.entry(p)
        self._json(200, list(entries.values()))

    def _preupload(self, m: re.Match[str], _q: Any, body: bytes) -> None:
        repo = self._repo(m["repo"], write=True)
        c = self._commit_at(repo, m["rev"])
        out = []
        for f in json.loads(body)["files"]:
            lfs = self.fake.is_lfs(f["path"], f["size"], base64.b64decode(f["sample"]))
            existing = c.files.get(f["path"])
            oid = None
            if existing is not None:  # what the client compares with its local oid
                oid = existing.sha256 if existing.lfs else git_oid(existing.data)
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": out, "commitOid": c.oid})

    def _batch(self, m: re.Match[str], _q: Any, body: bytes) -> None:
        self._repo(m["repo"], write=True)
        req = json.loads(body)
        if req.get("operation") != "upload":
            raise HubError(501, "the fake Hub only implements LFS uploads")
        base = self.fake.url
        objects: list[dict[str, Any]] = []
        multipart = False
        for o in req["objects"]:
            oid, size = o["oid"], int(o["size"])
            if oid in self.fake.objects:  # already stored: nothing to send (resumable)
                objects.append({"oid": oid, "size": size})
                continue
            verify = {"href": f"{base}/_lfs/{oid}/verify"}
            if size > self.fake.multipart_threshold and "multipart" in req.get("transfers", []):
                multipart = True
                n = -(-size // self.fake.multipart_chunk)
                header = {"chunk_size": str(self.fake.multipart_chunk),
                          **{str(i): f"{base}/_lfs/{oid}/part/{i}" for i in range(1, n + 1)}}
                upload = {"href": f"{base}/_lfs/{oid}/complete", "header": header}
            else:
                upload = {"href": f"{base}/_lfs/{oid}"}
            objects.append({"oid": oid, "size": size, "authenticated": True,
                            "actions": {"upload": upload, "verify": verify}})
        self._json(200, {"transfer": "multipart" if multipart else "basic", "objects": objects,
                         "hash_algo": "sha256"})

    def _store(self, oid: str, data: bytes) -> None:
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, f"uploaded content does not hash to {oid}")
        self.fake.objects[oid] = data

    def _put_object(self, m: re.Match[str], _q: Any, body: bytes) -> None:
        self._store(m["oid"], body)
        self._send(200, b"", content_type="text/plain")

    def _put_part(self, m: re.Match[str], _q: Any, body: bytes) -> None:
        self.fake.parts.setdefault(m["oid"], {})[int(m["n"])] = body
        self._send(200, b"", {"ETag": f'"{hashlib.md5(body).hexdigest()}"'},
                   content_type="text/plain")

    def _complete(self, m: re.Match[str], _q: Any, body: bytes) -> None:
        req = json.loads(body)
        parts = self.fake.parts.get(m["oid"], {})
        data = b""
        for p in sorted(req["parts"], key=lambda p: p["partNumber"]):
            chunk = parts.get(int(p["partNumber"]))
            if chunk is None or p["etag"].strip('"') != hashlib.md5(chunk).hexdigest():
                raise HubError(400, f"part {p['partNumber']} missing or etag mismatch")
            data += chunk
        self._store(m["oid"], data)
        self.fake.parts.pop(m["oid"], None)
        self._json(200, {"success": True})

    def _verify(self, m: re.Match[str], _q: Any, body: bytes) -> None:
        self._require_write()
        req = json.loads(body)
        data = self.fake.objects.get(m["oid"])
        if data is None or len(data) != int(req["size"]):
            raise HubError(404, f"object {m['oid']} not found")
        self._json(200, {"success": True})

    def _commit(self, m: re.Match[str], _q: Any, body: bytes) -> None:
        repo = self._repo(m["repo"], write=True)
        head = self._commit_at(repo, m["rev"])
        files = dict(head.files)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "the commit payload must start with a header line")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent and parent != head.oid:
            raise HubError(412, f"parent commit {parent} is not the head {head.oid}")
        for line in lines[1:]:
            key, v = line["key"], line["value"]
            if key == "file":
                data = base64.b64decode(v["content"])
                if self.fake.is_lfs(v["path"], len(data), data[:512]):
                    raise HubError(400, f"{v['path']} must be uploaded with LFS")
                files[v["path"]] = Blob(data, False)
            elif key == "lfsFile":
                data_ = self.fake.objects.get(v["oid"])
                if data_ is None:
                    raise HubError(400, f"LFS object {v['oid']} of {v['path']} was not uploaded")
                files[v["path"]] = Blob(data_, True)
            elif key == "deletedFile":
                if files.pop(v["path"], None) is None:
                    raise HubError(404, f"{v['path']} does not exist", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = v["path"].rstrip("/") + "/"
                files = {p: b for p, b in files.items() if not p.startswith(prefix)}
            else:
                raise HubError(501, f"the fake Hub does not implement commit key {key!r}")
        c = self.fake._commit(repo, header.get("summary", ""), header.get("description", ""),
                              files)
        self._json(200, {"success": True, "commitOid": c.oid,
                         "commitUrl": f"{self.fake.url}/{repo.id}/commit/{c.oid}",
                         "pullRequestUrl": None})

    def _resolve(self, m: re.Match[str], _q: Any, _b: bytes) -> None:
        repo = self._repo(m["repo"])
        c = self._commit_at(repo, m["rev"])
        blob = c.files.get(m["file"])
        if blob is None:
            raise HubError(404, f"{m['file']} does not exist", "EntryNotFound")
        headers = {"X-Repo-Commit": c.oid, "ETag": f'"{blob.oid}"', "Accept-Ranges": "bytes"}
        if blob.lfs:
            headers |= {"X-Linked-Etag": f'"{blob.sha256}"',
                        "X-Linked-Size": str(len(blob.data))}
        data, status = blob.data, 200
        rng = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        if rng and self.command == "GET":
            start = int(rng[1])
            end = int(rng[2]) if rng[2] else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start:end + 1], 206
        self._send(status, data, headers, content_type="application/octet-stream")


# --- run-folder stand-ins shared by the publish tests -------------------------------------
def write_eval_gate(run_dir: Any, *, fail: bool = False) -> dict[str, Any]:
    """Stand-ins for the eval and gate stages of a run that has an export: eval/eval.json and
    gate/gate.json in the run-folder contract's shape, recorded in the manifest with their
    hashes and the stage-key chain (eval.inputs.export, gate.inputs.eval). `fail` makes the
    blocking perplexity metric miss its threshold. Returns the gate result."""
    from pathlib import Path

    from quantize.run.files import atomic_write_json, hash_tree
    from quantize.run.manifest import read_manifest, write_manifest

    run_dir = Path(run_dir)
    metrics = [
        {"name": "wiki_ppl", "kind": "perplexity", "direction": "lower_is_better",
         "baseline": 17.94, "candidate": 31.2 if fail else 19.71, "baseline_stderr": None,
         "candidate_stderr": None, "threshold": 0.9, "on_fail": "block", "n": 16383,
         "settings": {"seq_len": 1024, "stride": 1024, "tokens": 16383}},
        {"name": "general_knowledge", "kind": "multiple_choice",
         "direction": "higher_is_better", "baseline": 0.3286, "candidate": 0.3143,
         "baseline_stderr": 0.0565, "candidate_stderr": 0.0558, "threshold": 0.85,
         "on_fail": "block", "n": 70,
         "settings": {"task": "bigbench:general_knowledge", "num_fewshot": 0, "limit": None}},
        {"name": "physical_intuition", "kind": "multiple_choice",
         "direction": "higher_is_better", "baseline": 0.4, "candidate": 0.3, "threshold": 0.85,
         "baseline_stderr": 0.05, "candidate_stderr": 0.05, "on_fail": "warn", "n": 81,
         "settings": {"task": "bigbench:physical_intuition", "num_fewshot": 0, "limit": None}},
    ]
    rows = []
    for m in metrics:
        b, c = m["baseline"], m["candidate"]
        m["recovery"] = b / c if m["direction"] == "lower_is_better" else c / b
        ok = m["recovery"] >= m["threshold"]
        verdict = "pass" if ok else ("fail" if m["on_fail"] == "block" else "warn")
        rows.append({k: m[k] for k in ("name", "baseline", "candidate", "recovery",
                                       "threshold")} | {"verdict": verdict, "note": ""})
    failures = [r["name"] for r in rows if r["verdict"] == "fail"]
    gate = {"verdict": "fail" if failures else "pass", "releasable": not failures,
            "failures": failures, "warnings": [r["name"] for r in rows if r["verdict"] == "warn"],
            "rows": rows}
    ev = {"suite": "default", "device": "cpu", "metrics": metrics}
    manifest = read_manifest(run_dir)
    atomic_write_json(run_dir / "eval" / "eval.json", ev)
    atomic_write_json(run_dir / "gate" / "gate.json", gate)
    export_key = manifest["stages"]["export"]["key"]
    eval_key = hashlib.sha256(f"eval:{export_key}".encode()).hexdigest()
    gate_key = hashlib.sha256(f"gate:{eval_key}".encode()).hexdigest()
    for stage, key, inputs in (("eval", eval_key, {"export": export_key}),
                               ("gate", gate_key, {"eval": eval_key})):
        manifest["stages"][stage] = {
            "key": key, "inputs": inputs, "status": "done",
            "started": "2026-01-01T00:00:00+00:00", "ended": "2026-01-01T00:00:01+00:00",
            "duration_s": 1.0, "outputs": hash_tree(run_dir / stage), "summary": {}}
    manifest["releasable"] = not failures
    write_manifest(run_dir, manifest)
    return gate
