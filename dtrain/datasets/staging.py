"""Staging a dataset: a local directory -> the `data` blob container -> the shared file system (read-only SAS).

upload: parallel, resumable (a file is sent only when no blob of that name has the same content MD5,
so a rerun after an interruption sends only what is missing or different), Content-MD5 set on every
blob and checked in transit, a progress bar with throughput and a summary table. With
--shard-size-mb, files are packed into deterministic tar shards first (many small files are slow to
list, transfer and store); `pull` unpacks them on the shared file system. With --short-side, the images are
first transcoded once (training/data/transcode.py) into a local cache and that copy is uploaded instead.
Every upload writes dataset.json at the dataset's root: how it was made (short side, quality, source).

pull: runs blob-pull on the storage host over SSH (through the jump host), the read-only SAS sent on
its stdin, into <data_path>/<dataset> as the nodes see it, then verifies the counts. The storage host is
the NFS server, or on a Lustre stack the head node, which mounts the file system as the nodes do; where
Lustre imported the `data` container at its creation (lustreImportData), the datasets already there are
read through it (their content comes from blob on that first read) and checked by MD5 like any file
found in place, and only what the import did not bring is copied.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import random
import re
import subprocess
import tarfile
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from azure.storage.blob import ContainerClient
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from dtrain import fileio
from dtrain.checks import ensure_directory
from dtrain.cluster import blobs
from dtrain.cluster.description import BlobCredential, BlobLocation, ClusterDescription
from dtrain.cluster.ssh import SSH, SSHFailure, explain_ssh_failure, q, storage_role
from dtrain.errors import ExitCode, OperatorError
from dtrain.ui import make_console
from infra.contract import BOOT_REPORT_DIR, HEALTH_REPORT_DIR, RUNS_DIR
from training.data.transcode import IMAGE_SUFFIXES, TranscodeError, TranscodeSummary, transcode_tree

console = make_console()
SHARD_PREFIX = "shards/"
MANIFEST = "dataset.json"  # at the dataset's root, never in a shard: readable without unpacking anything
SHORT_SIDE = (64, 1024)  # below 64 px nothing is left to crop; above 1024 the copy is hardly smaller
QUALITY = (50, 100)
DEFAULT_QUALITY = 90  # what FFCV stores its ImageNet copies at: artefacts hardly visible, files still small
# A dataset name is a blob prefix and a directory under data_path: plain components, '/' to nest.
# Each part starts with a letter, digit or `_`: `-x` would be read as a flag by blob-pull and the tools
# after it, `.x` is hidden (and `.`, `..` would leave the data path).
DATASET_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


# --- synthetic dataset -------------------------------------------------------------------------
def generate_synthetic_imagenet(
    out: str | Path,
    classes: int = 4,
    train_per_class: int = 16,
    val_per_class: int = 4,
    image_size: int = 64,
    seed: int = 0,
) -> dict[str, int]:
    """Write JPEGs in ImageNet layout: out/{train,val}/<wnid>/<wnid>_<n>.JPEG (ImageFolder-readable).

    Each class has its own colour and stripe pattern plus noise, so a model can learn it."""
    from PIL import Image, ImageDraw

    if classes < 1 or train_per_class < 1 or val_per_class < 0 or image_size < 8:
        raise OperatorError("generate: need classes >= 1, train-per-class >= 1, val-per-class >= 0, size >= 8")
    out = ensure_directory(out, "the output directory")
    rng = random.Random(seed)
    counts = {"train": 0, "val": 0}
    for c in range(classes):
        wnid = f"n{1440764 + c * 1000:08d}"
        base = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        stripe = 4 + c % 7
        for split, per_class in (("train", train_per_class), ("val", val_per_class)):
            folder = out / split / wnid
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                img = Image.new("RGB", (image_size, image_size), base)
                draw = ImageDraw.Draw(img)
                for x in range(0, image_size, stripe * 2):
                    shade = tuple(min(255, v + 60) for v in base)
                    draw.rectangle([x, 0, x + stripe - 1, image_size], fill=shade)
                # noise from our seeded generator (not PIL's effect_noise): same seed, same bytes
                noise = Image.frombytes("L", (image_size, image_size), rng.randbytes(image_size * image_size))
                noise = noise.convert("RGB")
                img = Image.blend(img, noise, 0.25)
                img.save(folder / f"{wnid}_{i:05d}.JPEG", "JPEG", quality=85)
                counts[split] += 1
    return counts


# --- local files and shards --------------------------------------------------------------------
def list_files(source: Path) -> list[tuple[str, Path]]:
    """(blob-relative posix name, path) for every regular file under source, sorted."""
    if not source.exists():
        raise OperatorError(f"dataset path {source} does not exist")
    if not source.is_dir():
        raise OperatorError(f"dataset path {source} is not a directory")
    files = sorted(
        (p.relative_to(source).as_posix(), p) for p in source.rglob("*") if p.is_file() and not p.is_symlink()
    )
    if not files:
        raise OperatorError(f"dataset path {source} has no files")
    return files


def pack_shards(files: list[tuple[str, Path]], shard_dir: Path, shard_size_mb: float) -> list[tuple[str, Path]]:
    """Pack files (in order) into tar shards of about shard_size_mb. Deterministic: the same files give
    byte-identical shards (fixed owner, mode and order), so MD5-based resume works on shards too; a
    shard whose member list (name, size, mtime) is unchanged is reused without being rewritten."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    limit = max(1, int(shard_size_mb * 1024 * 1024))
    groups: list[list[tuple[str, Path]]] = [[]]
    size = 0
    for name, path in files:
        length = path.stat().st_size
        if groups[-1] and size + length > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, path))
        size += length
    shards = []
    for index, group in enumerate(groups):
        shard = shard_dir / f"shard-{index:05d}.tar"
        manifest = [[name, p.stat().st_size, int(p.stat().st_mtime)] for name, p in group]
        manifest_path = shard.with_suffix(".json")
        if not (shard.exists() and manifest_path.exists() and json.loads(manifest_path.read_text()) == manifest):
            with fileio.atomic_path(shard) as tmp, tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as archive:
                for (name, path), (_, length, mtime) in zip(group, manifest, strict=True):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = length, mtime, 0o644
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    with open(path, "rb") as handle:
                        archive.addfile(info, handle)
            manifest_path.write_text(json.dumps(manifest))
        shards.append((SHARD_PREFIX + shard.name, shard))
    for stale in shard_dir.glob("shard-*.tar"):  # from an earlier, larger packing
        if stale.name >= f"shard-{len(groups):05d}.tar":
            stale.unlink()
            stale.with_suffix(".json").unlink(missing_ok=True)
    return shards


# --- upload ------------------------------------------------------------------------------------
@dataclass
class UploadSummary:
    container_url: str
    prefix: str
    source_files: int
    objects: int  # blobs that make up the dataset (files, or shards)
    uploaded: int = 0
    skipped: int = 0
    failed: int = 0
    bytes_uploaded: int = 0
    seconds: float = 0.0
    extra_remote: int = 0
    sharded: bool = False
    errors: list[str] = field(default_factory=list)
    transcoded: TranscodeSummary | None = None

    @property
    def mb_per_s(self) -> float:
        return self.bytes_uploaded / 1e6 / self.seconds if self.seconds else 0.0


def _hash_all(items: list[tuple[str, Path]], workers: int, cache_file: Path | None = None) -> dict[str, bytes]:
    """MD5 of every item. A cache (path -> size, mtime, md5) spares a rerun from reading unchanged
    files again: resuming a large upload should not mean hashing the whole dataset twice."""
    cache: dict[str, list] = {}
    if cache_file and cache_file.exists():
        with contextlib.suppress(ValueError, OSError):
            cache = json.loads(cache_file.read_text())

    def one(item: tuple[str, Path]) -> bytes:
        path = item[1]
        st = path.stat()
        hit = cache.get(str(path))
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return bytes.fromhex(hit[2])
        digest = fileio.file_md5(path)
        cache[str(path)] = [st.st_size, st.st_mtime_ns, digest.hex()]
        return digest

    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(one, items))
    if cache_file:
        with contextlib.suppress(OSError):  # the cache only saves time: an unwritable one is no failure
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            fileio.atomic_write(cache_file, json.dumps(cache))
    return {name: digest for (name, _), digest in zip(items, digests, strict=True)}


def upload(
    container: BlobLocation,
    credential: BlobCredential,
    source: str | Path,
    dataset: str,
    *,
    shard_size_mb: float | None = None,
    shard_dir: str | Path | None = None,
    workers: int = 8,
    show_progress: bool = True,
    md5_cache: Path | None = None,
    short_side: int | None = None,
    quality: int = DEFAULT_QUALITY,
) -> UploadSummary:
    """Upload a local dataset directory to <container>/<dataset>/ with ``credential`` (the
    operator's write access, not the container's read-only SAS), skipping what is already there.
    With ``short_side``, a transcoded copy (cached locally) is uploaded instead of the source."""
    dataset = check_dataset_name(dataset)
    source = Path(source).expanduser().resolve()
    transcoded = None
    tree = source
    if short_side:
        list_files(source)  # the same errors for a missing or empty source as without transcoding
        tree = transcoded_cache(source, short_side, quality)
        transcoded = transcode(source, tree, short_side, quality, show_progress)
    files = [(name, path) for name, path in list_files(tree) if name != MANIFEST]
    manifest = write_manifest(source, tree, dataset, files, short_side, quality)
    prefix = f"{dataset}/"
    if shard_size_mb:
        cache = ensure_directory(shard_dir or _cache_dir() / "shards" / dataset, "the shard directory")
        console.print(f"packing {len(files)} files into tar shards of {shard_size_mb:g} MB in {cache}")
        items = [*pack_shards(files, cache, shard_size_mb), (MANIFEST, manifest)]
    else:
        items = [*files, (MANIFEST, manifest)]
    sas = credential.secret.get_secret_value() if credential.kind == "sas" and credential.secret else None
    client = blobs.container_client(container, credential)
    summary = UploadSummary(
        container.url, prefix, len(files) + 1, len(items), sharded=bool(shard_size_mb), transcoded=transcoded
    )
    started = time.time()
    local = _hash_all(items, workers, md5_cache or _cache_dir() / "md5" / f"{_source_key(source)}.json")
    try:
        remote = blobs.remote_md5s(client, prefix)
    except Exception as exc:  # azure-core raises many types: one message
        raise blobs.explain(exc, f"listing {container.url}", sas) from None
    todo = [(name, path) for name, path in items if remote.get(prefix + name) != blobs.b64(local[name])]
    summary.skipped = len(items) - len(todo)
    wanted = {prefix + name for name, _ in items}
    summary.extra_remote = sum(1 for name in remote if name not in wanted)
    _Sender(client, summary, local, sas, show_progress).send(todo, workers)
    summary.seconds = round(time.time() - started, 3)
    return summary


def transcoded_cache(source: Path, short_side: int, quality: int) -> Path:
    """One cached copy per source and setting: another setting never overwrites, a rerun resumes."""
    return _cache_dir() / "transcoded" / f"{_source_key(source)}-s{short_side}-q{quality}"


def transcode(source: Path, dest: Path, short_side: int, quality: int, show_progress: bool) -> TranscodeSummary:
    progress = Progress(
        TextColumn(f"[bold]transcode[/bold] short side {short_side}, quality {quality}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not show_progress,
    )
    total = sum(1 for p in source.rglob("*") if p.is_file() and not p.is_symlink())
    task = progress.add_task("", total=total)
    console.print(f"transcoding {source} into {dest}")
    try:
        with progress:
            summary = transcode_tree(source, dest, short_side, quality, progress=lambda n: progress.advance(task, n))
    except TranscodeError as exc:
        raise OperatorError(f"transcode: {exc}", ExitCode.BAD_INPUT) from None
    console.print(
        f"transcoded {summary.transcoded} images ({summary.skipped} already done, {summary.failed} unreadable) "
        f"in {summary.seconds:.1f} s; the images: {summary.bytes_in / 1e6:.1f} MB -> {summary.bytes_out / 1e6:.1f} MB"
    )
    for err in summary.errors[:10]:
        console.print(f"skipped an unreadable image: {err}", style="red", markup=False)
    return summary


def write_manifest(
    source: Path, tree: Path, dataset: str, files: list[tuple[str, Path]], short_side: int | None, quality: int
) -> Path:
    """dataset.json for the upload: the source's own dataset.json (if any) extended with how this copy
    was made. Its created_at is kept while nothing else changes, so a rerun finds the blob unchanged."""
    own = tree / MANIFEST
    record = _read_json(own) if own.exists() else {}
    record.pop("created_at", None)  # the source's own date, if any, is replaced by this copy's
    record.update(
        short_side=short_side,
        quality=quality if short_side else None,
        source=str(source),
        images=sum(1 for name, _ in files if Path(name).suffix.lower() in IMAGE_SUFFIXES),
    )
    path = _cache_dir() / "manifests" / dataset / MANIFEST
    previous: dict = {}
    with contextlib.suppress(OperatorError):  # a damaged cached copy is only written again
        previous = _read_json(path) if path.exists() else {}
    if {k: v for k, v in previous.items() if k != "created_at"} == record:
        return path
    record["created_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write(path, json.dumps(record, indent=2) + "\n")
    return path


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OperatorError(f"{path} is not readable JSON: {exc}", ExitCode.BAD_INPUT) from None
    if not isinstance(value, dict):
        raise OperatorError(f"{path} must hold a JSON object", ExitCode.BAD_INPUT)
    return value


class _Sender:
    """Sends files in parallel and counts them in the summary. A refused or unreachable service
    stops every worker (nothing else would succeed either); any other failure is counted."""

    def __init__(
        self, client: ContainerClient, summary: UploadSummary, digests: dict[str, bytes], sas: str | None, show: bool
    ):
        self.client, self.summary, self.digests, self.sas = client, summary, digests, sas
        self.lock = threading.Lock()
        self.abort = threading.Event()
        self.progress = Progress(
            TextColumn("[bold]upload[/bold] {task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=not show,
        )
        self.task = self.progress.add_task("", total=None)

    def send(self, todo: list[tuple[str, Path]], workers: int) -> None:
        total = sum(path.stat().st_size for _, path in todo)
        description = f"{len(todo)} of {self.summary.objects} to send"
        self.progress.update(self.task, description=description, total=total or 1, completed=0 if todo else 1)
        with self.progress, ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = [pool.submit(self._one, item) for item in todo]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f.exception() for f in done if f.exception() is not None), None)
            if failed is not None:
                self.abort.set()
                for other in futures:
                    other.cancel()
                raise failed

    def _one(self, item: tuple[str, Path]) -> None:
        name, path = item
        if self.abort.is_set():
            return
        blob = self.summary.prefix + name
        try:
            sent = blobs.upload_file(self.client, path, blob, self.digests[name])
        except Exception as exc:
            err = blobs.explain(exc, f"writing {blob} to {self.summary.container_url}", self.sas)
            if err.exit_code == ExitCode.NOT_READY:
                self.abort.set()
                raise err from None
            with self.lock:
                self.summary.failed += 1
                self.summary.errors.append(str(err))
            return
        with self.lock:
            self.summary.uploaded += 1
            self.summary.bytes_uploaded += sent
        self.progress.advance(self.task, sent)


# --- pull onto the shared file system -------------------------------------------------------------
@dataclass
class PullSummary:
    host: str  # what pulled it: the NFS server, or the head node (Lustre)
    dest_on_nodes: str
    dest_on_storage: str
    listed: int
    downloaded: int
    skipped: int
    failed: int
    files_in_dest: int
    expected_files: int | None
    seconds: float
    raw: dict


def pull(
    desc: ClusterDescription,
    dataset: str,
    *,
    expected_files: int | None = None,
    expected_objects: int | None = None,
    workers: int = 16,
    sas: str | None = None,
    timeout: float = 6 * 3600,
) -> PullSummary:
    """Run blob-pull on the storage host into <data_path>/<dataset>; verify counts. SAS goes on stdin."""
    dest_nodes = dataset_path(desc, dataset)
    dest = desc.on_storage_host(dest_nodes)
    sas = sas or desc.data.credential.secret.get_secret_value()  # type: ignore[union-attr]
    pull_cmd = " ".join(q(part) for part in desc.blob_pull)
    command = (
        f"env -u BLOB_SAS {pull_cmd} --container-url {q(desc.data.url)} --dest {q(dest)} "
        f"--prefix {q(dataset + '/')} --workers {int(workers)} --unpack-tars"
    )
    started = time.time()
    with SSH(desc) as ssh:
        summary = _blob_pull(ssh, command, sas, timeout, storage_role(desc))
        count_cmd = (
            f"find {q(dest)} -type f -not -path {q(dest + '/.blob-pull/*')} "
            f"-not -path {q(dest + '/' + SHARD_PREFIX + '*')} -not -name '.*.part-*' | wc -l"
        )
        files_in_dest = int(ssh.run(ssh.storage, count_cmd, timeout=600).stdout.strip() or 0)
    result = PullSummary(
        host=storage_role(desc),
        dest_on_nodes=dest_nodes,
        dest_on_storage=dest,
        listed=summary["listed"],
        downloaded=summary["downloaded"],
        skipped=summary["skipped"],
        failed=summary["failed"],
        files_in_dest=files_in_dest,
        expected_files=expected_files,
        seconds=round(time.time() - started, 3),
        raw=summary,
    )
    _verify_pull(result, f"{desc.data.url}/{dataset}/", expected_objects)
    return result


def _blob_pull(ssh: SSH, command: str, sas: str, timeout: float, where: str) -> dict:
    """Run blob-pull on the storage host (`where`, in words), the SAS on its stdin and its stderr relayed live;
    its summary."""
    proc = subprocess.Popen(
        ssh.argv(ssh.storage, command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write((sas + "\n").encode())
        proc.stdin.close()
    stderr_lines: list[str] = []
    relay = threading.Thread(target=_relay, args=(proc.stderr, stderr_lines, where), daemon=True)
    relay.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        out = proc.stdout.read()
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    relay.join(5)
    if proc.returncode == -9:
        raise OperatorError(f"pull on the {where} did not finish within {timeout:.0f}s", ExitCode.TIMED_OUT)
    if proc.returncode == 255:
        raise SSHFailure(explain_ssh_failure(ssh.storage.label, "\n".join(stderr_lines), ssh.desc))
    summary = _last_json(out.decode(errors="replace"))
    if "error" in summary:  # blob-pull exits with the same table: 2 bad input, 3 storage refused or away
        known = proc.returncode in (ExitCode.BAD_INPUT, ExitCode.NOT_READY, ExitCode.TIMED_OUT)
        code = proc.returncode if known else ExitCode.FAILED
        raise OperatorError(f"pull on the {where} failed: {summary['error']}", code)
    if proc.returncode not in (0, 1) or not summary:  # 1: some blobs failed, verified by the caller
        tail = "\n".join(stderr_lines[-10:])
        raise OperatorError(f"pull on the {where} failed (exit {proc.returncode}):\n{tail}", ExitCode.FAILED)
    return summary


def _verify_pull(result: PullSummary, source_url: str, expected_objects: int | None) -> None:
    summary = result.raw
    problems = []
    if summary["failed"] or summary["present"] != summary["listed"]:
        problems.append(f"{summary['failed']} of {summary['listed']} blobs failed: {summary.get('errors', [])[:3]}")
    if summary["listed"] == 0:
        problems.append(f"no blobs under {source_url} (was it uploaded?)")
    if expected_objects is not None and summary["listed"] < expected_objects:
        problems.append(f"the container lists {summary['listed']} blobs, {expected_objects} were uploaded")
    if result.expected_files is not None and result.files_in_dest < result.expected_files:
        problems.append(f"{result.dest_on_storage} has {result.files_in_dest} files, expected {result.expected_files}")
    if problems:  # nothing listed at all: most likely a wrong --dataset
        code = ExitCode.BAD_INPUT if summary["listed"] == 0 else ExitCode.FAILED
        raise OperatorError("pull verification failed: " + "; ".join(problems), code)


def _relay(stream, lines: list[str], where: str) -> None:
    prefix = where.split(" (")[0].replace(" ", "-").lower()  # the host the lines come from: nfs-server, head-node
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        lines.append(line)
        console.print(f"{prefix}: {line}", style="dim", markup=False, highlight=False)


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return {}


# --- helpers -----------------------------------------------------------------------------------
def dataset_path(desc: ClusterDescription, dataset: str) -> str:
    """<data_path>/<dataset>, as the nodes see it; refused where that is one of the cluster's own directories
    (a Lustre import puts the datasets at the file system's root, beside runs/)."""
    dataset = check_dataset_name(dataset)
    path = posixpath.join(desc.data_path, dataset)
    own = [posixpath.join(desc.shared_mount_path, name) for name in (RUNS_DIR, HEALTH_REPORT_DIR, BOOT_REPORT_DIR)]
    if any(path == taken or path.startswith(taken + "/") for taken in own):
        raise OperatorError(
            f"dataset {dataset!r} would be {path}, the cluster's own directory on the shared file system: "
            "give it another name",
            ExitCode.BAD_INPUT,
        )
    return path


def check_dataset_name(dataset: str) -> str:
    name = dataset.strip("/")
    if not DATASET_NAME.fullmatch(name):
        raise OperatorError(
            f"invalid dataset name {dataset!r}: use letters, digits, '-', '_', '.' (and '/' to nest), each part "
            "starting with a letter, digit or '_'"
        )
    return name


def _source_key(source: Path) -> str:
    return hashlib.sha1(str(source).encode()).hexdigest()[:16]


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hvd-stage"
