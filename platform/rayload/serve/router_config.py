"""The A/B router's user_config: what a config must hold (config_issues, as ab_spec checks a
spec's), and the config in force as one immutable value (RouterConfig)."""

from __future__ import annotations

import dataclasses
import json

from .assign import Layout


def config_issues(config: dict, arms: list[str]) -> list[str]:
    """What is wrong with a router user_config (weights, champion, shadow, final), as ab_spec checks a spec's."""
    from ..ab_spec import weight_issues

    weights, champion = config.get("weights"), config.get("champion")
    if not isinstance(weights, dict):
        return [f"user_config.weights: must map each arm {arms} to its share (got {weights!r})"]
    if champion not in arms:
        return [f"user_config.champion: must be one of the arms {arms} (got {champion!r})"]
    if not isinstance(config.get("shadow", False), bool):  # "false" was accepted and turned shadow mode on
        return [f"user_config.shadow: true or false (got {config.get('shadow')!r})"]
    final = config.get("final")
    if final is not None and not (isinstance(final, dict) and final.get("decision") in ("promote", "rollback")
                                  and isinstance(final.get("reason"), str) and isinstance(final.get("time"), (int, float))):
        # a hand-edited one was kept, and every GET /experiment then failed reading it (a 500)
        return [f"user_config.final: null, or {{decision: promote | rollback, reason: text, time: seconds}} (got {final!r})"]
    issues = [i.render() for i in weight_issues(weights, arms, champion, "user_config.weights", bool(config.get("shadow", False)))]
    if final is not None and not issues and (why := final_weights_issue(weights, champion)):
        # GET /experiment reported "decided: promote, automatic steps have stopped" while traffic was still split
        issues.append(f"user_config.final: a {final['decision']} gives the champion all traffic: {why}")
    return issues


def final_weights_issue(weights: dict, champion: str) -> str | None:
    """Why `weights` are not those of a final decision (the champion 1.0, every other arm 0), or None."""
    if weights.get(champion) == 1.0 and all(w == 0 for a, w in weights.items() if a != champion):
        return None
    return f"weights {dict(weights)} with champion {champion!r}"


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The user_config in force, published by one assignment (ABRouter.config) and read once per
    request: Serve runs a sync reconfigure on a thread beside the requests, and with the fields
    set one by one a request could be assigned under one config and logged under another's
    weights (550 of 2,000 exposures in a probe), or read shadow and champion from two."""

    weights: dict
    champion: str
    shadow: bool
    layout: Layout
    layout_json: str
    final: dict | None  # a promote or rollback (decision, reason, time) that ended the automatic steps

    @classmethod
    def of(cls, config: dict, order: list[str]) -> "RouterConfig":
        """A user_config that config_issues accepted, for arms in `order`."""
        weights = {a: float(config["weights"][a]) for a in order}
        champion, shadow = config["champion"], bool(config.get("shadow", False))
        return cls(weights, champion, shadow, Layout.build(weights, champion, order), json.dumps(weights, sort_keys=True),
                   config.get("final"))
