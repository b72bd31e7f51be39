"""Fault injection for recovery tests and drills ($RAYLOAD_FAULT), read by the training loop."""

from __future__ import annotations

import os
import time


class Fault:
    """Fault injection for recovery tests and drills: $RAYLOAD_FAULT="epoch=1,rank=1,batch=50,marker=/p[,delay=5][,always=1]".

    It fires before the given batch of the epoch (default 0): mid-epoch, as real crashes do.
    The driver copies the variable into the loop's context (workers do not inherit the
    driver's environment). "once" exits the worker process hard (os._exit) unless the marker
    exists, creating it first; "always" raises on every attempt.
    """

    def __init__(self, text: str | None):
        self.conf = dict(part.partition("=")[::2] for part in text.split(",")) if text else {}

    @classmethod
    def from_context(cls, context: dict) -> "Fault":
        return cls(context.get("fault"))

    def maybe_fail(self, epoch: int, rank: int, batch: int) -> None:
        conf = self.conf
        if not conf or int(conf.get("epoch", -1)) != epoch or int(conf.get("rank", 0)) != rank or int(conf.get("batch", 0)) != batch:
            return
        if "always" in self.conf:
            raise RuntimeError(f"injected failure at epoch {epoch} on rank {rank}")
        marker = self.conf["marker"]
        if not os.path.exists(marker):
            open(marker, "w").close()
            # delay=S: Ray Train registers a reported checkpoint asynchronously; a drill that
            # must resume from it waits that long (a busy machine can take seconds).
            time.sleep(float(conf.get("delay", 0)))
            os._exit(1)  # a hard crash: no exception, no cleanup, like a killed process
