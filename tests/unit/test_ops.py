"""`rayload submit` and `rayload doctor` without Ray: stub job APIs stand in for clusters."""

import os

import pytest

from _ops import JOB
from rayload import ops


@pytest.mark.parametrize("var", ["RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"])
def test_submit_sends_the_job_and_the_token_only_to_the_address_given(job_api, tmp_path, monkeypatch, var):
    a_url, a_hits, _ = job_api()  # left in the shell for another cluster
    b_url, b_hits, _ = job_api()
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
