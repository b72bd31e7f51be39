"""`rayload doctor` and `rayload submit` against stub job APIs (real HTTP, no Ray): the auth
check asks the cluster, a spec that does not load is never uploaded, the job gets its
RAYLOAD_HOME, an unreachable address fails without ray.init (which retries for minutes),
and RAY_AUTH_TOKEN_PATH is honoured."""

import os
import re
import socket

import pytest
from typer.testing import CliRunner

from _ops import JOB, cli_app
from rayload import ops
from rayload.errors import RayloadError, SpecError



def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- doctor: token authentication


def test_doctor_asks_the_cluster_whether_it_requires_a_token_not_the_client(job_api, monkeypatch):
    """The client turns token mode on by itself when ~/.ray/auth_token exists; the check was
    'on' for a cluster without it. Now the job API is asked without a token."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # this client is in token mode either way
    open_url, _, _ = job_api(auth=False)
    closed_url, _, _ = job_api(auth=True)
    off = ops._auth(open_url)
    assert not off.ok and off.detail.startswith("OFF") and open_url in off.detail
    on = ops._auth(closed_url)
    assert on.ok and on.detail.startswith("on") and closed_url in on.detail
    assert ops.auth_required(closed_url.removeprefix("http://")) is True  # Ray records the dashboard without a scheme
    assert ops.auth_required(f"http://127.0.0.1:{_closed_port()}") is None


def test_doctor_without_a_job_api_asks_a_node_of_the_cluster(monkeypatch):
    monkeypatch.setattr(ops, "_cluster_auth_mode", lambda: False)
    check = ops._auth(f"127.0.0.1:{_closed_port()}")
    assert not check.ok and check.detail.startswith("OFF")
    monkeypatch.setattr(ops, "_cluster_auth_mode", lambda: True)
    assert ops._auth(f"127.0.0.1:{_closed_port()}").ok


# ---------------------------------------------------------------- doctor / ensure_ray: unreachable address


def test_an_unreachable_address_fails_in_seconds_naming_it(monkeypatch):
    import ray

    from rayload import _ray

    def no_init(*args, **kwargs):
        raise AssertionError("ray.init retries an unreachable GCS for minutes: it must not be called")

    monkeypatch.setattr(ray, "init", no_init)
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(RayloadError, match=f"nothing answers at {address}"):
        _ray.ensure_ray(address)
    with pytest.raises(RayloadError, match="not a Ray address"):
        _ray.ensure_ray("127.0.0.1:notaport")
    check = ops._ray_check(address)
    assert not check.ok and address in check.detail  # ray.init (minutes of retries) was never called: no_init
    for left_to_ray in ("auto", "ray://10.0.0.1:10001", "http://127.0.0.1:8265"):
        _ray.check_reachable(left_to_ray)  # Ray's own lookup, the Ray client, a URL: not a host:port to probe


# ---------------------------------------------------------------- submit


def test_submit_refuses_a_spec_that_does_not_load_before_anything_is_uploaded(job_api, tmp_path, monkeypatch):
    url, hits, submitted = job_api()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(JOB.replace("name: x", "name: x\ntrain: {epochs: -1}"))
    (tmp_path / "job.yaml").write_text(JOB)
    with pytest.raises(SpecError, match="train.epochs"):
        ops.submit("bad.yaml", url, wait=False)
    with pytest.raises(SpecError, match="train.epochs"):
        ops.submit("job.yaml", url, ["train.train.epochs=abc"], wait=False)  # a --set value that does not fit
    assert hits == [] and submitted == []

    r = CliRunner().invoke(cli_app(), ["submit", "job.yaml", "--address", url, "--set", "train.train.epochs=abc", "--no-wait"])
    assert r.exit_code == 2, r.output
    assert hits == [] and submitted == []


def test_submit_sends_the_jobs_rayload_home_when_one_is_given(job_api, tmp_path, monkeypatch):
    """Without RAYLOAD_HOME a submitted job's run folders went into Ray's temporary copy of the upload."""
    url, _, submitted = job_api()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAYLOAD_JOB_HOME", raising=False)
    (tmp_path / "job.yaml").write_text(JOB)
    assert ops.submit("job.yaml", url, ["train.train.epochs=2"], wait=False, home="/data/rayload-runs") == ("raysubmit_stub", "PENDING")
    env = submitted[-1]["runtime_env"]["env_vars"]
    assert env["RAYLOAD_HOME"] == "/data/rayload-runs" and env["PYTHONPATH"] == "platform"
    assert submitted[-1]["entrypoint"] == "python -m rayload run job.yaml --set train.train.epochs=2"
    ops.submit("job.yaml", url, wait=False)  # none given: the cluster's own (cluster.yaml sets it) applies
    assert "RAYLOAD_HOME" not in submitted[-1]["runtime_env"]["env_vars"]
    with pytest.raises(RayloadError, match="absolute path"):
        ops.submit("job.yaml", url, wait=False, home="runs")

    monkeypatch.setenv("RAYLOAD_JOB_HOME", "/srv/runs")
    r = CliRunner().invoke(cli_app(), ["submit", "job.yaml", "--address", url, "--no-wait"])
    assert r.exit_code == 0, r.output
    assert submitted[-1]["runtime_env"]["env_vars"]["RAYLOAD_HOME"] == "/srv/runs"


def test_runs_root_inside_a_ray_upload_is_not_the_upload(tmp_path, monkeypatch):
    from rayload.paths import in_ray_upload, runs_root

    upload = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    upload.mkdir(parents=True)
    monkeypatch.chdir(upload)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAYLOAD_HOME")
    assert in_ray_upload(str(upload)) and not in_ray_upload(str(tmp_path))
    assert runs_root() == str(tmp_path / "home" / "rayload-runs")
    monkeypatch.setenv("RAYLOAD_HOME", "~/elsewhere")
    assert runs_root() == str(tmp_path / "home" / "elsewhere")
    monkeypatch.delenv("RAYLOAD_HOME")
    monkeypatch.chdir(tmp_path)
    assert runs_root() == str(tmp_path / "runs")


# ---------------------------------------------------------------- RAY_AUTH_TOKEN_PATH


def test_the_token_file_named_by_ray_auth_token_path_is_used(tmp_path, monkeypatch):
    import ray._private.authentication.authentication_token_setup as setup

    from rayload import _ray

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.ray/auth_token
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    token = tmp_path / "cluster-token"
    token.write_text("tok-123\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert ops.token() == "tok-123"
    enabled = []
    monkeypatch.setattr(setup, "maybe_enable_token_auth_if_token_available", lambda **kw: enabled.append(kw))
    _ray._token_env()
    assert enabled == [{"warn_if_disabled": False}]
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    assert ops.token() is None
    _ray._token_env()
    assert len(enabled) == 1  # no token anywhere: token mode is not switched on
    monkeypatch.setenv("RAY_AUTH_TOKEN", "tok-env")  # the token given in the env alone switches it on too (it did not)
    _ray._token_env()
    assert len(enabled) == 2
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the mode given is the user's
    _ray._token_env()
    assert len(enabled) == 2


def test_a_refused_or_missing_token_names_the_file_really_read(tmp_path, monkeypatch, job_api):
    """The 403 message named ~/.ray/auth_token whatever RAY_AUTH_TOKEN_PATH chose. Against a
    job API that takes only its own token: a wrong one read from the file is refused (403), no
    file sends none (401); the right one passes."""
    url, hits, _ = job_api(auth=True, token="right")
    token = tmp_path / "team-token"
    token.write_text("tok\n")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    with pytest.raises(RayloadError, match=re.escape(f"refused the token in {token} (403)")):
        ops.check_job_api(url, ops.token())
    assert hits[-1][2] == "Bearer tok"  # the file's token was sent
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "absent"))
    with pytest.raises(RayloadError, match=re.escape(f"write it to {tmp_path / 'absent'}")):
        ops.check_job_api(url, ops.token())
    assert hits[-1][2] is None
    token.write_text("right\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    ops.check_job_api(url, ops.token())


def test_an_address_without_a_port_is_named_before_ray_init(monkeypatch):
    """ray.init raised ValueError("Invalid address format"): a traceback and exit 1 for
    train, preprocess, tune, serve, evaluate and doctor."""
    import ray

    from rayload import _ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ray.init reached")))
    with pytest.raises(RayloadError, match=r"not a Ray address: '10.0.0.5' \(host:port of the cluster's GCS, e.g. 10.0.0.5:6379"):
        _ray.check_reachable("10.0.0.5")
    for fine in ("auto", "local", "ray://10.0.0.5:10001"):
        _ray.check_reachable(fine)


def test_submit_refuses_a_spec_the_uploads_gitignore_leaves_out(tmp_path):
    """Only rayload's own excludes were checked: build/job.yaml, ignored by the repository's
    .gitignore, passed, was not uploaded, and the job failed on the cluster."""
    from rayload._upload import check_spec

    (tmp_path / ".gitignore").write_text("/build/\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".rayignore").write_text("secret/\n")
    for folder in ("build", "jobs", "sub/secret"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "job.yaml").write_text(JOB)
    with pytest.raises(SpecError, match=r"ignored by the .gitignore or .rayignore in \./: it would not be uploaded"):
        check_spec(str(tmp_path / "build" / "job.yaml"), working_dir=str(tmp_path))
    with pytest.raises(SpecError, match=r"ignored by the .gitignore or .rayignore in sub/"):
        check_spec(str(tmp_path / "sub" / "secret" / "job.yaml"), working_dir=str(tmp_path))
    check_spec(str(tmp_path / "jobs" / "job.yaml"), working_dir=str(tmp_path))


def test_the_upload_check_reads_each_stage_spec_as_the_stage_does(tmp_path, monkeypatch):
    """It read a stage's search or A/B spec without the stage's `set` and listed A/B arms the
    stage replaces with earlier stages' models: a checkpoint arm under runs/ that the stage never
    reads was refused, and a base job the stage's `set` moved into runs/ was let through."""
    import shutil

    from rayload._upload import check_spec

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for folder in ("jobs", "tune"):
        shutil.copytree(os.path.join(root, folder), tmp_path / folder)
    (tmp_path / "runs" / "train" / "r1" / "epoch_0001").mkdir(parents=True)
    shutil.copy(tmp_path / "jobs" / "movielens_deepfm.yaml", tmp_path / "runs" / "base.yaml")
    (tmp_path / "jobs" / "ab_ck.yaml").write_text(
        "name: ab_ck\narms:\n  - {name: a, weight: 0.9, checkpoint: ../runs/train/r1/epoch_0001}\n"
        "  - {name: b, weight: 0.1, job: movielens_deepfm.yaml}\nchampion: a\n")
    (tmp_path / "jobs" / "filled.yaml").write_text(
        "name: p\nstages:\n  - {name: base, kind: train, job: movielens_deepfm.yaml}\n"
        "  - {name: search, kind: tune, search: ../tune/movielens_bayes.yaml}\n"
        "  - {name: ab, kind: ab, spec: ab_ck.yaml, champion: base, challenger: search, traffic: simulate}\n")
    (tmp_path / "jobs" / "moved.yaml").write_text(
        "name: p2\nstages:\n  - {name: search, kind: tune, search: ../tune/movielens_bayes.yaml, set: [base=../runs/base.yaml]}\n")
    monkeypatch.chdir(tmp_path)
    check_spec("jobs/filled.yaml", [], ".")
    with pytest.raises(SpecError, match=r"stages\.0 \(search\).search -> base: in an excluded folder \(runs/\)"):
        check_spec("jobs/moved.yaml", [], ".")
    (tmp_path / "jobs" / "arms.yaml").write_text("name: p3\nstages:\n  - {name: ab, kind: ab, spec: ab_ck.yaml, traffic: simulate}\n")
    with pytest.raises(SpecError, match=r"stages\.0 \(ab\).spec -> arms\.0\.checkpoint: in an excluded folder \(runs/\)"):
        check_spec("jobs/arms.yaml", [], ".")


def test_the_serve_port_check_sees_a_port_held_on_any_address():
    """It bound 127.0.0.1 only: a port held on another address read free, and Serve on 0.0.0.0
    (direct ingress) could not bind it."""
    with socket.socket() as held:
        held.bind(("127.0.0.2", 0))
        held.listen()
        port = held.getsockname()[1]
        assert ops._port(port).ok is False
    assert ops._port(_closed_port()).ok is True
