"""Training-plumbing review fixes (2026-11-27), without Ray: a multi-worker run whose ranks get
less than one micro-batch each is refused before training (it took no step and reported
epochs and checkpoints of the initial weights); a worker no node can hold is refused with a
message about nodes, not totals that would fit."""

import pytest

from _loop import MemorySession, features, job, table
from rayload.spec import ResourcesSpec
from rayload.train import resources
from rayload.train.loop import run
from rayload.train.trainer import TrainingError


class TwoRanks(MemorySession):
    """A session that says it is one of two ranks (nothing distributed is reached: the run is refused first)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.world_size = 2


def test_ranks_with_less_than_one_micro_batch_each_are_refused_naming_the_settings(tmp_path):
    session = TwoRanks(table(400, 0), table(64, 1), str(tmp_path))
    with pytest.raises(TrainingError, match=r"each of the 2 workers gets 200 training rows, fewer than one micro-batch of 256 "
                                            r"\(train.batch_size 256 / train.accumulation 1\)"):
        run(job(epochs=1), features(), session, {"train_rows": 400, "manifest": {}})
    assert session.reports == []
    one = MemorySession(table(400, 0), table(64, 1), str(tmp_path / "one"))  # one worker keeps its short batch: it trains
    run(job(epochs=1), features(), one, {"train_rows": 400, "manifest": {}})
    assert len(one.reports) == 1 and one.reports[0][0]["train_rows"] == 400


def _cluster(monkeypatch, nodes):
    from ray._private import state

    monkeypatch.setattr(state.state, "get_max_resources_from_cluster_config", lambda: None)
    monkeypatch.setattr(resources, "_v1_autoscaler_running", lambda: False)
    monkeypatch.setattr(resources, "alive_nodes", lambda: [{"Alive": True, "Resources": n} for n in nodes])


def test_a_worker_no_node_can_hold_is_refused_naming_the_largest_node(monkeypatch):
    _cluster(monkeypatch, [{"CPU": 2.0}, {"CPU": 2.0}])
    with pytest.raises(resources.ResourceError) as info:
        resources.check_resources(ResourcesSpec(workers=1, cpus_per_worker=3))
    msg = str(info.value)
    assert "each worker must fit on one node: the 2 node(s) place 0 (the largest has CPU=2" in msg and "in total" not in msg
    _cluster(monkeypatch, [{"CPU": 2.0}, {"CPU": 1.0}])
    with pytest.raises(resources.ResourceError, match=r"the 2 node\(s\) place 1 "):
        resources.check_resources(ResourcesSpec(workers=2, cpus_per_worker=1.5))
    _cluster(monkeypatch, [{"CPU": 2.0}])  # past the totals: the message about totals, as before
    with pytest.raises(resources.ResourceError, match="in total"):
        resources.check_resources(ResourcesSpec(workers=3, cpus_per_worker=1))
