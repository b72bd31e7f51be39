"""`rayload submit` and `rayload doctor` without Ray: stub job APIs stand in for clusters."""

import http.server
import json
import os
import threading

import pytest

from rayload import ops


@pytest.fixture
def cluster():
    """A stub Ray job API: it answers the version and job-list calls, accepts the upload and
    the submission (job "raysubmit_stub"), and logs what reaches it."""
    servers = []

    def make():
        hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)  # the upload's bytes: read, not kept
                hits.append((self.command, self.path, self.headers.get("Authorization")))
                code = 200
                if self.path.startswith("/api/version"):
                    body = json.dumps({"version": "4", "ray_version": "2.60.0", "ray_commit": "x"}).encode()
                elif self.path.startswith("/api/jobs/") and self.command == "GET":
                    body = b"[]"
                elif self.path.startswith("/api/packages/"):  # not there yet (GET), then uploaded (PUT)
                    code, body = (404 if self.command == "GET" else 200), b""
                elif self.path.startswith("/api/jobs/") and self.command == "POST":
                    body = json.dumps({"job_id": "raysubmit_stub", "submission_id": "raysubmit_stub"}).encode()
                else:
                    code, body = 500, b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = _any

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", hits

    yield make
    for server in servers:
        server.shutdown()


# A job spec that loads (its data is never read here): `rayload submit` checks the spec before the upload.
JOB = """name: x
data:
  source: {kind: csv, path: /no/such/data/*.csv}
  columns:
    - {name: user, role: categorical}
    - {name: price, role: numeric}
  label: {column: clicked, task: binary}
features:
  numeric: {price: {}}
  categorical: {user: {}}
"""


@pytest.mark.parametrize("var", ["RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"])
def test_submit_sends_the_job_and_the_token_only_to_the_address_given(cluster, tmp_path, monkeypatch, var):
    a_url, a_hits = cluster()  # left in the shell for another cluster
    b_url, b_hits = cluster()
    monkeypatch.setenv(var, a_url)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "token-for-B")
    (tmp_path / "job.yaml").write_text(JOB)
    monkeypatch.chdir(tmp_path)
    assert ops.submit("job.yaml", b_url, wait=False) == ("raysubmit_stub", "PENDING")
    assert a_hits == []
    assert ("GET", "/api/jobs/", "Bearer token-for-B") in b_hits and any(p.startswith("/api/version") for _, p, _ in b_hits)
    assert any(c == "PUT" and p.startswith("/api/packages/") for c, p, _ in b_hits)  # the upload went to B too
    assert ("POST", "/api/jobs/", "Bearer token-for-B") in b_hits  # and so did the submission, with B's token
    assert os.environ[var] == a_url  # the caller's environment is left as it was


def test_doctor_shows_database_urls_without_their_passwords(tmp_path):
    (tmp_path / "ab.yaml").write_text("name: t\nevents: {url: 'postgresql://postgres:S3cretPw@127.0.0.1:1/test'}\n")
    (tmp_path / "tune.yaml").write_text("name: s\nstorage: 'postgresql://optuna:An0therPw@127.0.0.1:notaport/studies'\n")
    checks = ops._databases(str(tmp_path))
    assert len(checks) == 2 and not any(c.ok for c in checks)  # nothing listens there
    shown = " ".join(f"{c.name} {c.detail}" for c in checks)
    assert "S3cretPw" not in shown and "An0therPw" not in shown, shown
    assert "postgresql://postgres:***@127.0.0.1:1/test" in shown and "optuna:***@" in shown
