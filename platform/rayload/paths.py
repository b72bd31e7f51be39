"""Where rayload keeps its files when a spec does not say."""

from __future__ import annotations

import contextlib
import fcntl
import os

# A name that becomes one folder under runs/ (a job, run, search, experiment, pipeline or
# stage): one path component, not "." or ".." (nor hidden). With "." a pipeline's --run-id or
# stage folder was runs/ itself or its run folder, which a re-run then deleted whole.
NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"
# At most this long: a run folder adds a timestamp to the name, and past the file system's 255
# bytes a folder cannot be made (an OSError traceback after the spec had validated). A job's
# name and run name may be longer: rayload makes some from other names (retrain-<experiment>-
# <stamp>, ab-<experiment>-<arm>-<fingerprint>: up to 207 characters). A run or cache folder
# adds at most 23 to a job's name; a k-fold run's name adds -<stamp>-fold<k> (at most 30) to
# it, or -fold<k> to a given run name, which is the run folder's name itself.
NAME_MAX, JOB_NAME_MAX, RUN_NAME_MAX = 128, 200, 250


# Where a submitted job's run folders go when neither the job nor the cluster sets RAYLOAD_HOME.
JOB_HOME = "~/rayload-runs"


def runs_root() -> str:
    """Root of run folders and caches: $RAYLOAD_HOME, else ./runs, except inside a Ray job's
    uploaded working directory (`ray job submit --working-dir`, `rayload submit`): that is
    Ray's temporary copy of the upload, removed with it, so ~/rayload-runs there."""
    home = os.environ.get("RAYLOAD_HOME")
    if home:
        return os.path.abspath(os.path.expanduser(_local_folder("RAYLOAD_HOME", home)))
    if in_ray_upload(os.getcwd()):
        return os.path.expanduser(JOB_HOME)
    return os.path.abspath("runs")


def in_ray_upload(folder: str) -> bool:
    """Whether `folder` is inside a working directory Ray unpacked for a job or task
    (<session>/runtime_resources/working_dir_files/...)."""
    parts = os.path.normpath(os.path.abspath(folder)).split(os.sep)
    return any(a == "runtime_resources" and b == "working_dir_files" for a, b in zip(parts, parts[1:]))


def cache_root() -> str:
    """Materialised built-in sources and preprocessed shards: $RAYLOAD_CACHE, else
    $RAYLOAD_HOME/cache. Several run folders (users, jobs) on one machine can share one cache:
    entries are keyed by content and written under `cache_lock`."""
    cache = os.environ.get("RAYLOAD_CACHE")  # ~ expanded, as RAYLOAD_HOME's (it was a folder named "~" here)
    return os.path.abspath(os.path.expanduser(_local_folder("RAYLOAD_CACHE", cache))) if cache else os.path.join(runs_root(), "cache")


def _local_folder(name: str, value: str) -> str:
    """`value` of the env var `name`, which must be a folder path: a URI (s3://...) became a local
    folder named "s3:" under the working directory, without a word."""
    if "://" in value:
        from .errors import RayloadError

        raise RayloadError(f"{name}={value}: a folder path, not a URI (object storage is not supported there yet); "
                           "for a cache or run folders shared by the nodes, mount shared storage (EFS, NFS) and name its path")
    return value


@contextlib.contextmanager
def cache_lock(entry: str):
    """Hold an exclusive lock on a local cache entry (an flock on `entry`.lock) while it is
    checked and written: a second process that wants the same entry waits, then finds it
    finished instead of writing the same files under the first one. Remote entries (a URL) are
    not locked: the last writer wins there, and a reader only trusts an entry whose _SUCCESS
    marker names its key."""
    if "://" in entry:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(entry)), exist_ok=True)
    with open(f"{entry}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # said, or a second process sat silent for as long as the first one's preprocessing
            import logging

            logging.getLogger("rayload.data").warning("waiting for another process writing %s", entry)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def exclusive(lock_file: str, busy: str):
    """Hold an flock on `lock_file` (made if missing; released if the holder dies) while the
    block runs; a RayloadError saying `busy` if another process holds it."""
    from .errors import RayloadError

    os.makedirs(os.path.dirname(os.path.abspath(lock_file)), exist_ok=True)
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RayloadError(busy) from None
        yield


def lock_file(where: str) -> str:
    """A lock file for the thing at `where` (a folder or URI) in this machine's /tmp, keyed by its
    location with symlinks resolved: nothing is written beside it (a refused launch leaves nothing
    behind), and it guards the processes of this machine. /tmp itself, not $TMPDIR, which a job
    runner may set per job (two launches then took two locks)."""
    import hashlib
    import tempfile

    key = where if is_remote(where) else os.path.realpath(where)
    root = "/tmp" if os.access("/tmp", os.W_OK) else tempfile.gettempdir()
    return os.path.join(root, f"rayload-locks-{os.getuid()}", hashlib.sha256(key.encode()).hexdigest()[:20] + ".lock")


def shared_storage(storage_path: str | None) -> str | None:
    """Where checkpoints go instead of this machine's run folders, if anywhere: a job's
    train.storage_path, else the cluster's RAYLOAD_STORAGE_PATH (cluster.yaml sets it), as
    `storage_location` resolves it."""
    return storage_location(storage_path or os.environ.get("RAYLOAD_STORAGE_PATH"))


def storage_location(path: str | None) -> str | None:
    """A storage path as every reader and writer of a run must name it: a local path with `~`
    expanded and made absolute against this process's working directory (the in-process loop
    joined it as given, so `~` became a folder named `~`; Ray Train's pyarrow refused a relative
    one in a worker, after preprocessing); a URI with a scheme (s3://, gs://, file://) as given."""
    if not path or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def remote_scratch(remote: str, kind: str) -> str:
    """The local folder where this node writes what belongs at the URI `remote` before it goes
    there (a run's checkpoints, mirrored as they are written; a compressed checkpoint):
    `<runs>/<kind>/remote/<hash of the URI>/<last part>`, one per URI, so a relaunch on this
    node resumes its run and runs with the same name elsewhere stay apart."""
    import hashlib

    name = remote.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]
    return os.path.join(runs_root(), kind, "remote", hashlib.sha256(remote.encode()).hexdigest()[:12], name)


def upload_folder(local: str, remote: str, last: tuple[str, ...] = ()) -> str:
    """Copy a local folder to a URI on object storage (what is there under the same names is
    replaced); returns the URI. Files named in `last` (top level) go up after every other
    file: a checkpoint's model.pt, whose size and time key the readers' caches (`localize`),
    so a reader never caches a new model.pt beside old files of a folder written again."""
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(remote)
    root = root.rstrip("/")
    fs.create_dir(root, recursive=True)
    local_fs = pafs.LocalFileSystem()
    for name in sorted(os.listdir(local), key=lambda n: (n in last, n)):
        source, target = os.path.join(local, name), f"{root}/{name}"
        if os.path.isdir(source):
            fs.create_dir(target, recursive=True)
        pafs.copy_files(source, target, source_filesystem=local_fs, destination_filesystem=fs)
    return remote


def remove_folder(remote: str) -> None:
    """Delete a folder on object storage (nothing when it is not there)."""
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(remote)
    if fs.get_file_info(root).type == pafs.FileType.Directory:
        fs.delete_dir(root)


def write_text(uri: str, text: str, durable: bool = False, private: bool = False) -> None:
    """Write one small file on object storage (or a local path) whole: readers see the old
    text or the new, never part of it (an object store's PUT is atomic; locally a rename).
    `durable` (local files): the text and the rename are on disk before this returns, so a
    crash of the machine brings back neither an empty file nor the old one. `private` (local
    files): readable by this user alone (0600), for files that may hold a database URL's password."""
    if not is_remote(uri):
        local = local_path(uri)
        tmp = f"{local}.tmp"
        if os.path.exists(tmp):  # a crash's leftover keeps its mode through os.open: start anew
            os.remove(tmp)
        with open_private(tmp) if private else open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, local)
        if durable:
            _fsync_folder(os.path.dirname(os.path.abspath(local)))
        return
    import pyarrow.fs as pafs

    fs, where = pafs.FileSystem.from_uri(uri)
    with fs.open_output_stream(where) as f:
        f.write(text.encode())


def open_private(path: str):
    """`path` opened for writing text, readable by its owner alone (0600): for files that may
    hold a database URL's password. An existing regular file is made 0600 too (O_CREAT keeps
    an existing file's mode); anything else (a symlink's target, /dev/stdout) is written as it is."""
    import contextlib
    import stat

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o600)
    return os.fdopen(fd, "w")


def _fsync_folder(folder: str) -> None:
    """A rename is durable only once its folder is."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str, obj, durable: bool = False, private: bool = False) -> None:
    """`obj` as indented JSON, written whole (`write_text`)."""
    import json

    write_text(path, json.dumps(obj, indent=1, default=str), durable, private)


def read_text(path: str) -> str:
    """One small file's text, from this machine's disk or from a URI on object storage (only
    that file is fetched, not the folder it is in)."""
    if not is_remote(path):
        with open(local_path(path)) as f:
            return f.read()
    import pyarrow.fs as pafs

    fs, where = pafs.FileSystem.from_uri(path)
    if fs.get_file_info(where).type != pafs.FileType.File:
        raise FileNotFoundError(f"no file at {path}")
    with fs.open_input_stream(where) as f:
        return f.read().decode()


def local_path(path: str) -> str:
    """A local path (~ expanded), or a file:// URI as the path it names: percent-escapes decoded,
    as pyarrow (and so Ray Train) reads them (file:///tmp/my%20runs is /tmp/my runs; taken
    literally, rayload read its records from another folder than Ray Train wrote them to)."""
    if path.startswith("file://"):
        from urllib.parse import unquote

        return unquote(path[len("file://"):])
    return os.path.expanduser(path)


def is_remote(path: str) -> bool:
    """A URI on a filesystem other than this machine's disk (s3://, gs://, ...); file:// is local."""
    return "://" in path and not path.startswith("file://")


def join_uri(base: str, *parts: str) -> str:
    """`base` with path parts appended: a local path as os.path.join does; a URI's parts go
    before its query, which carries the filesystem's options
    (s3://bucket/runs?endpoint_override=host:9000 + x -> s3://bucket/runs/x?endpoint_override=host:9000)."""
    if "://" not in base:
        return os.path.join(base, *parts)
    head, sep, query = base.partition("?")
    return "/".join([head.rstrip("/"), *(p.strip("/") for p in parts)]) + sep + query


def uri_for(storage: str, fs_path: str) -> str:
    """The URI of `fs_path` (a path on the filesystem pyarrow resolved `storage` to, without
    its scheme, as Ray Train's Checkpoint.path is) in the form `storage` has: local paths stay
    paths; s3://bucket/x?query + bucket/x/run/ckpt -> s3://bucket/x/run/ckpt?query."""
    if not is_remote(storage):
        return fs_path
    scheme, rest = storage.split("://", 1)
    location, sep, query = rest.partition("?")
    host = location.split("/", 1)[0]
    if fs_path.startswith("/") and host:  # a host-based filesystem (hdfs://namenode:8020/...): its paths are absolute
        return f"{scheme}://{host}{fs_path}{sep}{query}"
    return f"{scheme}://{fs_path.lstrip('/')}{sep}{query}"


def localize(path: str) -> str:
    """A checkpoint folder on this machine's disk: `path` itself when it is local, else (an
    s3://, gs:// or other pyarrow filesystem URI, as Ray Train writes to a cluster's shared
    storage) a copy downloaded once into the local cache, under
    `<cache>/checkpoints/<hash>/<run>/<checkpoint>`, the hash of the URI and of its model.pt's
    size and modification time: a finished copy is reused while the checkpoint is unchanged,
    and a checkpoint written again under the same name is fetched again. A copy is completed in
    a temporary folder and renamed into place, so a reader never sees half of one."""
    import hashlib

    if not is_remote(path):
        return local_path(path)
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(path)
    root = root.rstrip("/")
    parts = root.split("/")
    weights = fs.get_file_info(f"{root}/model.pt")
    key = f"{path}|{weights.size}|{weights.mtime_ns}" if weights.type == pafs.FileType.File else path
    dest = os.path.join(cache_root(), "checkpoints", hashlib.sha256(key.encode()).hexdigest()[:16], *parts[-2:])
    if os.path.exists(os.path.join(dest, "model.json")):
        return dest
    download_folder(path, dest)
    return dest


def plain_name(name: object) -> bool:
    """One folder or file name that stays where it is joined: not empty, ".", "..", nor holding a
    separator or NUL (names read from object storage are another party's to write)."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\x00")


def download_folder(remote: str, local: str) -> None:
    """Copy a folder on object storage to `local` (which must not exist yet): completed in a
    temporary folder beside it and renamed into place, so a reader never sees half of one; if
    another process finished the same copy first, that copy stays."""
    import shutil
    import uuid

    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(remote)
    root = root.rstrip("/")
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"no checkpoint folder at {remote}")
    tmp = f"{local}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
            parts = [p for p in info.path[len(root) + 1:].split("/") if p]  # a//b is a/b, as a file system reads it
            if not parts:  # the folder's own marker object
                continue
            if not all(map(plain_name, parts)):  # a key with ../ in it wrote outside the folder
                from .errors import RayloadError

                raise RayloadError(f"{remote} holds an object whose key leaves the folder ({info.path!r}); not downloaded")
            target = os.path.join(tmp, *parts)
            if info.type == pafs.FileType.Directory:
                os.makedirs(target, exist_ok=True)
            elif info.type == pafs.FileType.File:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with fs.open_input_stream(info.path) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        try:
            os.rename(tmp, local)
        except OSError:  # another process finished the same copy first
            if not os.path.isdir(local):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_SECRET_PARAMS = ("password", "passfile", "sslpassword")  # libpq's query parameters that hold or point at secrets


def shown_url(url: str | None) -> str:
    """A database URL as printed (errors and tables end up in terminals and CI logs): its
    password masked, in user:password@ and in the query (?password=, which libpq reads too)."""
    import re

    if url is None:
        return "None"
    try:
        import sqlalchemy

        masked = sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses: mask user:password@ by hand
        masked = re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)
    return re.sub(r"(?i)([?&](?:%s)=)[^&#]*" % "|".join(_SECRET_PARAMS), r"\1***", masked)
