"""A search of any Python objective (`tuning.tune_function`): its argument checks, how the
objective reaches the trial processes, and how its return value becomes Tune's result."""

from __future__ import annotations

from typing import Any

from .errors import RayloadError, SpecIssue


def _cpus_issues(cpus) -> list[SpecIssue]:
    """tune_function's `cpus` (each trial's CPUs): a positive finite number. -1 reached the
    resource check inside the run as a ResourcesSpec error about cpus_per_worker."""
    import math
    import numbers

    if isinstance(cpus, numbers.Real) and not isinstance(cpus, bool) and math.isfinite(cpus) and cpus > 0:
        return []
    return [SpecIssue("cpus", "each trial's CPUs: a number > 0 (fractions share a CPU between trials)", cpus, True)]


def _fn_issues(fn, address) -> list[SpecIssue]:
    """tune_function's objective is called with one dict per trial, and `address` is a Ray
    address or None: a string, a lambda of no arguments or address=5 started Ray and failed
    every trial inside it instead."""
    import inspect

    out = []
    if not callable(fn):
        out.append(SpecIssue("fn", "the objective must be a callable taking one dict of parameters", fn, True))
    else:
        try:
            inspect.signature(fn).bind({})
        except TypeError as exc:
            out.append(SpecIssue("fn", f"the objective is called with one dict of parameters, which {fn!r} does not take ({exc})"))
        except ValueError:  # no signature to read (some builtins): let the call decide
            pass
    if address is not None and not isinstance(address, str):
        out.append(SpecIssue("address", "a Ray address such as 'auto' or 'ray://head:10001', or None for a local Ray", address, True))
    return out


def _scheduler_issues(spec) -> list[SpecIssue]:
    """ASHA stops every trial at its max_t: a job search takes it from the base job's epochs, a
    function has none, and 100 was used unsaid (a function reporting 500 steps was cut at 100
    and recorded complete)."""
    if spec.scheduler is None or spec.scheduler.max_epochs is not None:
        return []
    return [SpecIssue("scheduler.max_epochs", "a searched function has no epochs to default to: give the most steps a trial "
                      "reports (ASHA stops each trial there)")]


def _ship_by_value(fn) -> None:
    """Trial processes may not import the objective's module (a script, a test file, a
    notebook): send its code along instead of a reference, unless it is an installed package."""
    import sys
    import sysconfig

    from ray import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(module, "__file__", None) or ""
    installed = path.startswith((sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]))
    if module is not None and module.__name__ != "__main__" and path and not installed:
        cloudpickle.register_pickle_by_value(module)


def _function_trial(config: dict, fn, metric: str) -> None:
    import ray.tune

    out = fn(dict(config["params"]))
    if out is not None:
        # done=True ends the trial with this result; otherwise Tune asks once more and waits
        # up to 0.2 s (its result-queue timeout) to notice the function has returned.
        ray.tune.report({**function_result(out, metric), "done": True})


def function_result(out: Any, metric: str) -> dict:
    """What an objective returned, as the result Tune is told: a number, or a dict holding the
    metric; the metric becomes a Python float (numpy float32 and other reals included). Anything
    else raises here, in the trial, which then fails with that reason while the search goes on."""
    import numbers

    result = dict(out) if isinstance(out, dict) else {metric: out}
    if metric not in result:
        raise RayloadError(f"the objective returned a dict without the metric {metric!r} (keys: {', '.join(map(str, result)) or 'none'}); "
                           f"return {{{metric!r}: value, ...}} or the value itself")
    value = result[metric]
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise RayloadError(f"the objective's {metric!r} is {value!r} ({type(value).__name__}), not a real number")
    return {**result, metric: float(value)}
