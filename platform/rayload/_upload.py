"""What `rayload submit` uploads (the working folder without UPLOAD_EXCLUDES) and the check that
every file a submitted run reads is part of that upload, before anything is sent."""

from __future__ import annotations

import os

from .errors import SpecError, SpecIssue

# Never uploaded with a job: local runs, the virtual environment, caches, VCS data.
UPLOAD_EXCLUDES = ["runs/", ".venv/", "**/__pycache__/", ".pytest_cache/", "benchmarks/out/", ".git/", "*.egg-info/"]


def check_spec(spec: str, sets=(), working_dir: str | None = None) -> None:
    """The spec loads here as `rayload run` will load it on the cluster (every stage's spec, the
    `--set` values applied): a broken one fails before anything is uploaded, naming the field.
    With `working_dir`, every file the run reads (each stage's spec, a search's base job, an A/B
    arm's job or local checkpoint) must be uploaded with it: one outside it or in an excluded
    folder (runs/, ...) was found missing on the cluster, after the upload."""
    from .pipeline_spec import _FILE_FIELD, load_pipeline

    pipeline = load_pipeline(spec, list(sets))
    if working_dir is None:
        return
    # (field, path, given relative): a path given absolute may lie on storage the cluster shares,
    # so only its being in an excluded folder of the upload is refused
    files = [("spec", spec, True)]
    for i, stage in enumerate(pipeline.stages):
        field = _FILE_FIELD.get(stage.kind)
        if not field:
            continue
        given = getattr(stage, field)
        path = pipeline.path(given)
        where = f"stages.{i} ({stage.name}).{field}"
        files.append((where, path, not os.path.isabs(os.path.expanduser(given))))
        files += [(w, p, False) for w, p in _read_by(stage, path, where)]
    issues = []
    for where, path, relative in files:
        why = None if "://" in path else _not_uploaded(path, working_dir)
        if why and (relative or not why.startswith("outside")):
            issues.append(SpecIssue(where, f"{why}: it would not be uploaded with --working-dir {working_dir}", path, True))
    if issues:
        raise SpecError(issues, file=spec)


def _read_by(stage, path: str, where: str) -> list[tuple[str, str]]:
    """The files a stage's own spec names in turn, as the stage reads it (its `set` applied): a
    search's base job, an A/B arm's job or checkpoint (none when the stage fills its arms with
    earlier stages' models). Read without the stage's `set`, a base it moved was missed and arms
    it replaces were refused."""
    if stage.kind == "tune":
        from .search_job import load_search_spec

        return [(f"{where} -> base", load_search_spec(path, stage.set).base)]
    if stage.kind == "ab" and not stage.champion:
        from .ab_spec import load_ab_spec

        return [(f"{where} -> arms.{j}.{'job' if arm.job else 'checkpoint'}", arm.job or arm.checkpoint)
                for j, arm in enumerate(load_ab_spec(path, stage.set).arms) if arm.job or arm.checkpoint]
    return []


def _not_uploaded(path: str, working_dir: str) -> str | None:
    """Why `path` is not part of the upload of `working_dir` (UPLOAD_EXCLUDES as Ray reads
    them, gitignore style: a folder pattern without an inner slash matches at any depth), or None."""
    import fnmatch

    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(working_dir))
    if relative == ".." or relative.startswith(".." + os.sep):
        return "outside the working directory"
    parts = relative.split(os.sep)
    for pattern in UPLOAD_EXCLUDES:
        body = pattern.rstrip("/").removeprefix("**/")
        folders = parts[:-1] if pattern.endswith("/") else parts
        if "/" in body:  # anchored at the root: benchmarks/out
            depth = body.count("/") + 1
            if len(folders) >= depth and fnmatch.fnmatch("/".join(folders[:depth]), body):
                return f"in an excluded folder ({pattern})"
        elif any(fnmatch.fnmatch(part, body) for part in folders):
            return f"in an excluded folder ({pattern})"
    return _ignored(relative, working_dir)


def _ignored(relative: str, working_dir: str) -> str | None:
    """Whether Ray's upload leaves the file out by a .gitignore or .rayignore on its way: Ray's own
    matchers, applied as its upload walks the folder (each folder's ignore files match the paths
    below it). `build/job.yaml`, ignored by the repository's .gitignore, passed the check and was
    missing on the cluster."""
    from pathlib import Path

    from ray._private.ray_constants import RAY_RUNTIME_ENV_IGNORE_GITIGNORE
    from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

    import logging

    quiet = logging.getLogger("rayload.upload_check")  # Ray logs each ignore file it finds at INFO
    quiet.setLevel(logging.WARNING)
    include_gitignore = os.environ.get(RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    root = Path(os.path.abspath(working_dir))
    chain = [root, *(root.joinpath(*Path(relative).parts[:i + 1]) for i in range(len(Path(relative).parts)))]
    matchers = []
    for path in chain:  # as Ray's _dir_travel: a folder's own ignore files first, then the folder itself is matched
        if path.is_dir():
            matchers += [(m, path) for m in get_excludes_from_ignore_files(path, include_gitignore=include_gitignore, logger=quiet)]
        if hit := next((where for match, where in matchers if match(path)), None):
            return f"ignored by the .gitignore or .rayignore in {os.path.relpath(hit, root)}/"
    return None
