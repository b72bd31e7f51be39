"""simulate_and_decide without Ray or HTTP: where each slice of traffic is sent."""

from types import SimpleNamespace

from rayload.serve import control, simulate


def test_each_slice_asks_the_url_provider_again_so_a_replaced_replicas_new_port_is_used(monkeypatch):
    ports = iter(range(30000, 30100))
    asked, sent = [], []

    def live_urls():  # as control.live_urls answers with direct ingress after a replica restart
        asked.append(f"http://h:{next(ports)}")
        return [asked[-1]]

    monkeypatch.setattr(simulate, "simulate", lambda url, world, users, n, *a, **k: sent.append(url) or simulate.SimResult(n, n, 0, {200: n}))
    monkeypatch.setattr(control, "analysis_for", lambda run: SimpleNamespace(decision="continue", reasons=[]))
    out = simulate.simulate_and_decide("run", live_urls, None, users=10, requests=30, auto=False, chunks=3)
    assert out.requests == 30 and sent == [["http://h:30000"], ["http://h:30001"], ["http://h:30002"]]
    fixed = simulate.simulate_and_decide("run", "http://h:8000", None, users=10, requests=20, auto=False, chunks=2)
    assert fixed.requests == 20 and sent[-2:] == ["http://h:8000", "http://h:8000"]
