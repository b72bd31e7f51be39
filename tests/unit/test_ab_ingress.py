"""Where clients reach an A/B router with Serve's proxy, without Ray: Serve's live HTTP options
(a stand-in for its client) against the spec's serving.host:port."""

import logging
from types import SimpleNamespace

import pytest

from rayload.serve import ingress

SERVING = {"ingress": "proxy", "host": "127.0.0.1", "port": 8712, "route_prefix": "/exp2", "replicas": 1}


@pytest.fixture
def serve_running(monkeypatch):
    """Serve already started with these HTTP options (or not at all: None)."""
    import ray.serve.context

    def make(host=None, port=None):
        client = None if host is None else SimpleNamespace(http_config=SimpleNamespace(host=host, port=port))
        monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda **kwargs: client)

    return make


def test_the_proxy_url_is_where_serve_already_listens_and_the_ignored_port_is_said(serve_running, caplog):
    serve_running("127.0.0.1", 8711)  # another experiment started Serve on 8711
    with caplog.at_level(logging.WARNING, logger="rayload.serve.ingress"):
        assert ingress.ingress_urls(SERVING, "exp2") == ["http://127.0.0.1:8711/exp2"]
    assert "8712" in caplog.text and "ignored" in caplog.text


def test_the_spec_host_stays_behind_a_wildcard_bind_and_nothing_is_said_when_they_agree(serve_running, caplog):
    serve_running("0.0.0.0", 8712)
    with caplog.at_level(logging.WARNING, logger="rayload.serve.ingress"):
        assert ingress.ingress_urls(SERVING, "exp2") == ["http://127.0.0.1:8712/exp2"]
    assert caplog.text == ""
    serve_running("10.0.0.5", 8712)  # a fixed bind is reached only there
    assert ingress.ingress_urls({**SERVING, "host": "0.0.0.0"}, "exp2") == ["http://10.0.0.5:8712/exp2"]
    serve_running()  # Serve not running: the spec's own
    assert ingress.ingress_urls(SERVING, "exp2") == ["http://127.0.0.1:8712/exp2"]
