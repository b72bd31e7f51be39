"""Up-front refusals of what a cluster cannot run: storage every node sees, resources that fit."""

import io

from rayload.train import resources

MOUNTS = "/dev/sda1 / ext4 rw 0 0\nserver:/export /data nfs4 rw 0 0\nserver:/scratch /mnt/shared/ nfs rw 0 0\n"


def test_shared_mounts_hold_the_paths_below_them_by_whole_components(monkeypatch):
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: io.StringIO(MOUNTS) if p == "/proc/mounts" else real_open(p, *a, **k))
    monkeypatch.delenv("RAYLOAD_SHARED_PATHS", raising=False)
    assert resources.is_shared("/data") and resources.is_shared("/data/runs") and resources.is_shared("/data/")
    assert not resources.is_shared("/database/runs") and not resources.is_shared("/data2")  # on ext4 /
    assert resources.is_shared("/mnt/shared/runs") and not resources.is_shared("/mnt/sharedx")
    monkeypatch.setenv("RAYLOAD_SHARED_PATHS", "/srv/team/")
    assert resources.is_shared("/srv/team/runs") and not resources.is_shared("/srv/teammate")
