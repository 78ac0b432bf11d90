"""Staging against real Azurite and a real pull over SSH (through the jump host) onto the shared directory."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from azure.core.exceptions import HttpResponseError
from azure.storage.blob import ContainerClient, ContainerSasPermissions, ContentSettings, generate_container_sas
from PIL import Image

from dtrain.cluster.blobs import container_client
from dtrain.cluster.description import ClusterDescription
from dtrain.datasets import staging
from dtrain.errors import OperatorError
from dtrain.local import cluster as local_cluster
from dtrain.remote.boot import blob_pull
from tests.polling import wait_for

from .conftest import run_module, start_module


def md5_b64(path: Path) -> str:
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def admin(desc: ClusterDescription) -> ContainerClient:
    return container_client(desc.data, desc.staging_credential)


def remote_md5s(desc: ClusterDescription, prefix: str) -> dict[str, str]:
    out = {}
    for blob in admin(desc).list_blobs(name_starts_with=prefix):
        digest = blob.content_settings.content_md5
        out[blob.name[len(prefix) :]] = base64.b64encode(bytes(digest)).decode() if digest else ""
    return out


def sas(desc: ClusterDescription, permission: ContainerSasPermissions, expiry: datetime) -> str:
    return generate_container_sas(
        local_cluster.AZURITE_ACCOUNT, "data", account_key=local_cluster.AZURITE_KEY, permission=permission,
        expiry=expiry, start=expiry - timedelta(hours=2), protocol="https,http",
    )  # fmt: skip


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("jpegs")
    counts = staging.generate_synthetic_imagenet(out, classes=3, train_per_class=6, val_per_class=2, image_size=32)
    assert counts == {"train": 18, "val": 6}
    return out


def test_synthetic_generator_layout_and_determinism(jpegs, tmp_path):
    files = sorted(p.relative_to(jpegs).as_posix() for p in jpegs.rglob("*") if p.is_file())
    assert len(files) == 24
    assert files[0] == "train/n01440764/n01440764_00000.JPEG"
    assert {f.split("/")[0] for f in files} == {"train", "val"}
    assert len({f.split("/")[1] for f in files}) == 3
    with Image.open(jpegs / files[0]) as img:
        assert img.format == "JPEG" and img.size == (32, 32) and img.mode == "RGB"
    again = tmp_path / "again"
    staging.generate_synthetic_imagenet(again, classes=3, train_per_class=6, val_per_class=2, image_size=32)
    assert md5_b64(again / files[5]) == md5_b64(jpegs / files[5])


def test_upload_sets_content_md5_and_pull_verifies_counts(cluster, cluster_dir, jpegs):
    summary = staging.upload(cluster.data, cluster.staging_credential, jpegs, "plain", workers=4, show_progress=False)
    assert (summary.source_files, summary.uploaded, summary.skipped, summary.failed) == (25, 25, 0, 0)  # + dataset.json
    remote = remote_md5s(cluster, "plain/")
    manifest = json.loads(admin(cluster).download_blob("plain/dataset.json").readall())
    assert remote.pop("dataset.json") and manifest.pop("created_at")
    assert manifest == {"short_side": None, "quality": None, "source": str(jpegs), "images": 24}
    assert remote == {p.relative_to(jpegs).as_posix(): md5_b64(p) for p in jpegs.rglob("*") if p.is_file()}
    # the local storage account's files are root's alone, as the data is the account's on Azure
    blob_store = cluster_dir / "azurite"
    shared = [
        f"{oct(p.stat().st_mode & 0o777)} {p}" for p in [blob_store, *blob_store.rglob("*")] if p.stat().st_mode & 0o077
    ]
    assert not shared, shared

    pulled = staging.pull(cluster, "plain", expected_files=25, expected_objects=25)
    assert (pulled.listed, pulled.downloaded, pulled.failed, pulled.files_in_dest) == (25, 25, 0, 25)
    dest = Path(cluster.data_path) / "plain"
    assert pulled.dest_on_nodes == str(dest)
    for path in jpegs.rglob("*.JPEG"):
        assert md5_b64(dest / path.relative_to(jpegs)) == md5_b64(path)
    assert json.loads((dest / "dataset.json").read_text())["images"] == 24
    # a second pull finds everything in place (same MD5) and downloads nothing
    again = staging.pull(cluster, "plain", expected_files=25)
    assert (again.downloaded, again.skipped) == (0, 25)


def test_on_lustre_the_imported_files_are_checked_in_place_and_only_the_rest_is_copied(cluster, jpegs):
    """A stack whose Lustre imported the `data` container at its creation: the datasets are at the file
    system's root, beside runs/, and the head node pulls. Whatever the import brought (here: every image)
    is checked by its MD5 in place and kept; what came after the import (dataset.json) is copied."""
    lustre = cluster.model_copy(update={"shared_storage": "lustre", "data_path": cluster.shared_mount_path})
    staging.upload(cluster.data, cluster.staging_credential, jpegs, "imported", workers=4, show_progress=False)
    root = Path(cluster.shared_mount_path) / "imported"
    for path in jpegs.rglob("*.JPEG"):  # what Lustre's import shows under the root
        (root / path.relative_to(jpegs)).parent.mkdir(parents=True, exist_ok=True)
        (root / path.relative_to(jpegs)).write_bytes(path.read_bytes())
    pulled = staging.pull(lustre, "imported", expected_files=25, expected_objects=25)
    assert (pulled.host, pulled.dest_on_nodes) == ("head node (Lustre)", str(root))
    assert (pulled.listed, pulled.skipped, pulled.downloaded, pulled.failed) == (25, 24, 1, 0)
    assert json.loads((root / "dataset.json").read_text())["images"] == 24
    # a dataset may not land on the cluster's own directories there
    with pytest.raises(OperatorError, match="the cluster's own directory") as refused:
        staging.pull(lustre, "runs")
    assert refused.value.exit_code == 2


def test_changed_file_is_the_only_one_sent_again(cluster, jpegs, tmp_path):
    src = tmp_path / "src"
    staging.generate_synthetic_imagenet(src, classes=2, train_per_class=3, val_per_class=1, image_size=16)
    first = staging.upload(cluster.data, cluster.staging_credential, src, "changed", show_progress=False)
    assert first.uploaded == 9  # 8 images and dataset.json
    victim = next(src.rglob("*.JPEG"))
    victim.write_bytes(victim.read_bytes() + b"\0")
    second = staging.upload(cluster.data, cluster.staging_credential, src, "changed", show_progress=False)
    assert (second.uploaded, second.skipped) == (1, 8)
    assert remote_md5s(cluster, "changed/")[victim.relative_to(src).as_posix()] == md5_b64(victim)


def test_pull_rejects_content_that_does_not_match_its_md5(cluster, tmp_path):
    src = tmp_path / "src"
    staging.generate_synthetic_imagenet(src, classes=1, train_per_class=3, val_per_class=0, image_size=16)
    staging.upload(cluster.data, cluster.staging_credential, src, "corrupt", show_progress=False)
    name = "corrupt/train/n01440764/n01440764_00001.JPEG"
    # the stored Content-MD5 no longer matches the bytes: what a corrupted object looks like to a reader
    admin(cluster).get_blob_client(name).set_http_headers(
        ContentSettings(content_type="image/jpeg", content_md5=bytearray(hashlib.md5(b"other").digest()))
    )
    with pytest.raises(OperatorError, match=r"pull verification failed: 1 of 4 blobs failed.*MD5 verification failed"):
        staging.pull(cluster, "corrupt", expected_files=3)
    dest = Path(cluster.data_path) / "corrupt" / "train" / "n01440764"
    assert not (dest / "n01440764_00001.JPEG").exists()  # never moved into place
    assert not list(dest.glob(".*part*"))  # no partial file left behind
    assert len(list(dest.glob("*.JPEG"))) == 2


def test_upload_resumes_after_a_kill(cluster, cluster_file, tmp_path):
    src = tmp_path / "bulk"
    total = 300
    for i in range(total):
        folder = src / "train" / f"n{i % 10:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img_{i:04d}.JPEG").write_bytes(os.urandom(96 * 1024))
    proc = start_module(
        "dtrain", "stage", "upload", str(src), "--cluster", str(cluster_file), "--dataset", "resume",
        "--workers", "1", "--no-progress",
    )  # fmt: skip
    client = admin(cluster)

    def count() -> int:
        return sum(1 for _ in client.list_blobs(name_starts_with="resume/"))

    try:
        wait_for(lambda: count() >= 20 or proc.poll() is not None, 120, "the first uploads", interval=0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the upload finished before it could be interrupted"
    time.sleep(0.5)
    before = count()
    assert 0 < before < total

    resumed = staging.upload(cluster.data, cluster.staging_credential, src, "resume", workers=4, show_progress=False)
    assert (resumed.skipped, resumed.uploaded, resumed.failed) == (before, total + 1 - before, 0)  # + dataset.json
    local = {p.relative_to(src).as_posix(): md5_b64(p) for p in src.rglob("*") if p.is_file()}
    remote = remote_md5s(cluster, "resume/")
    assert remote.pop("dataset.json") and remote == local  # nothing lost, nothing corrupted
    third = staging.upload(cluster.data, cluster.staging_credential, src, "resume", show_progress=False)
    assert (third.uploaded, third.skipped) == (0, total + 1)


def test_tar_shards_are_resumable_and_unpacked_on_pull(cluster, jpegs, tmp_path):
    shard_dir = tmp_path / "shards"
    summary = staging.upload(
        cluster.data,
        cluster.staging_credential,
        jpegs,
        "sharded",
        shard_size_mb=0.01,
        shard_dir=shard_dir,
        show_progress=False,
    )
    assert summary.sharded and 1 < summary.objects < summary.source_files
    remote = remote_md5s(cluster, "sharded/")
    assert remote.pop("dataset.json") and all(name.startswith("shards/shard-") for name in remote)
    again = staging.upload(
        cluster.data,
        cluster.staging_credential,
        jpegs,
        "sharded",
        shard_size_mb=0.01,
        shard_dir=shard_dir,
        show_progress=False,
    )
    assert (again.uploaded, again.skipped) == (0, summary.objects)  # byte-identical shards
    pulled = staging.pull(cluster, "sharded", expected_files=25, expected_objects=summary.objects)
    assert pulled.raw["unpacked_files"] == 24 and pulled.files_in_dest == 25  # dataset.json is no shard member
    dest = Path(cluster.data_path) / "sharded"
    for path in jpegs.rglob("*.JPEG"):
        assert md5_b64(dest / path.relative_to(jpegs)) == md5_b64(path)


def test_read_only_sas_cannot_write(cluster, jpegs):
    read_only = cluster.data.credential  # the SAS the nodes and the NFS server get: read + list
    client = container_client(cluster.data)
    assert sum(1 for _ in client.list_blobs()) >= 0  # it may list ...
    with pytest.raises(HttpResponseError) as err:  # ... but not write
        client.upload_blob("plain/evil.txt", b"x")
    assert err.value.status_code == 403
    with pytest.raises(OperatorError, match="does not grant this permission") as op:
        staging.upload(cluster.data, read_only, jpegs, "ro-attempt", show_progress=False)
    assert op.value.exit_code == 3
    assert not remote_md5s(cluster, "ro-attempt/")


def test_expired_sas_gives_a_clear_error(cluster, cluster_file, jpegs):
    expired = sas(
        cluster, ContainerSasPermissions(read=True, list=True, write=True), datetime.now(UTC) - timedelta(hours=1)
    )
    started = time.time()
    with pytest.raises(OperatorError, match=r"the SAS token expired at \d{4}-\d\d-\d\dT") as err:
        staging.pull(cluster, "plain", sas=expired)
    assert err.value.exit_code == 3
    # the same through the CLIs an operator runs: blob-pull itself, and an upload with that SAS
    dest = Path(cluster.data_path) / "never"
    proc = run_module(
        "dtrain.remote.boot.blob_pull", "--container-url", cluster.data.url, "--dest", str(dest),
        env={"BLOB_SAS": expired}, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3 and "the SAS token expired at" in proc.stderr
    up = run_module(
        "dtrain", "stage", "upload", str(jpegs), "--cluster", str(cluster_file), "--dataset", "x",
        "--sas-env", "STAGE_SAS", "--no-progress", env={"STAGE_SAS": expired}, timeout=60,
    )  # fmt: skip
    assert up.returncode == 3 and "the SAS token expired at" in up.stderr
    assert time.time() - started < 60


def test_wrong_sas_and_missing_dataset_path(cluster, cluster_file):
    wrong = cluster.data.credential.secret.get_secret_value().replace("sig=", "sig=AAAA")
    with pytest.raises(OperatorError, match="blob authorization failed while listing the container"):
        staging.pull(cluster, "plain", sas=wrong)
    proc = run_module(
        "dtrain", "--cluster", str(cluster_file), "stage", "upload", "/nonexistent/imagenet", "--dataset", "x",
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "error: dataset path /nonexistent/imagenet does not exist" in proc.stderr


def test_blob_pull_is_stdlib_only_and_refuses_escaping_names():
    source = Path(blob_pull.__file__).read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {
        "argparse", "base64", "contextlib", "errno", "hashlib", "http", "json", "os", "sys", "tarfile", "threading",
        "time", "traceback", "urllib", "xml", "concurrent", "datetime",
    }  # fmt: skip
    assert source.startswith("#!/usr/bin/env python3")
    with pytest.raises(blob_pull.BlobError, match="outside the destination"):
        blob_pull.local_path("/dest", "data/../../etc/passwd", "data/")
    assert blob_pull.local_path("/dest", "ds/train/a.JPEG", "ds/") == "/dest/train/a.JPEG"


def test_blob_pull_takes_the_sas_from_stdin_never_argv(cluster, tmp_path):
    dest = tmp_path / "pulled"
    proc = run_module(
        "dtrain.remote.boot.blob_pull", "--container-url", cluster.data.url, "--dest", str(dest), "--prefix", "plain/",
        input=cluster.data.credential.secret.get_secret_value() + "\n", timeout=60, env={"BLOB_SAS": ""},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert '"listed": 25' in proc.stdout and len(list(dest.rglob("*.JPEG"))) == 24
    # progress: blobs and bytes out of the totals listed, and the rate
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["present_bytes"] == summary["listed_bytes"] > 0
    mb = re.escape(f"{summary['listed_bytes'] / 1e6:.1f}")
    assert re.search(rf"^blob-pull: 25/25 blobs, {mb}/{mb} MB \(100%\), [\d.]+ MB/s, 0 failed$", proc.stderr, re.M)
    options = set(blob_pull.build_parser()._option_string_actions)
    assert not {"--sas", "--sas-token", "--token"} & options and "--sas-env" in options  # names a variable only


def test_rerun_does_not_hash_unchanged_files_again(cluster, jpegs, monkeypatch):
    staging.upload(cluster.data, cluster.staging_credential, jpegs, "hashcache", show_progress=False)
    calls = []
    real = staging.fileio.file_md5
    monkeypatch.setattr(staging.fileio, "file_md5", lambda path: calls.append(path) or real(path))
    again = staging.upload(cluster.data, cluster.staging_credential, jpegs, "hashcache", show_progress=False)
    assert (again.skipped, calls) == (25, [])
    victim = next(jpegs.rglob("*.JPEG"))
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 1))
    staging.upload(cluster.data, cluster.staging_credential, jpegs, "hashcache", show_progress=False)
    assert calls == [victim]


def test_generate_then_stage_all_through_the_cli(cluster, cluster_file, tmp_path):
    src = tmp_path / "mini"
    made = run_module(
        "dtrain", "stage", "generate", str(src), "--classes", "2", "--train-per-class", "2", "--val-per-class", "1",
        "--image-size", "16", timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert len(list(src.rglob("*.JPEG"))) == 6
    proc = run_module(
        "dtrain", "stage", "all", str(src), "--dataset", "cli-all", "--no-progress",
        env={"CLUSTER_DESCRIPTION": str(cluster_file)}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [next(iter(line)) for line in lines] == ["upload", "pull"]
    assert (lines[0]["upload"]["uploaded"], lines[1]["pull"]["files_in_dest"]) == (7, 7)
    dest = Path(cluster.data_path) / "cli-all"
    for path in src.rglob("*.JPEG"):
        assert md5_b64(dest / path.relative_to(src)) == md5_b64(path)


def test_stage_all_with_short_side_sends_the_transcoded_copy(cluster, cluster_file, tmp_path):
    src = tmp_path / "big"
    staging.generate_synthetic_imagenet(src, classes=2, train_per_class=3, val_per_class=1, image_size=200)
    argv = ["dtrain", "stage", "all", str(src), "--dataset", "small", "--short-side", "64", "--quality", "80"]
    proc = run_module(*argv, "--no-progress", env={"CLUSTER_DESCRIPTION": str(cluster_file)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    up, pulled = (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    transcoded = up["upload"]["transcoded"]
    assert (transcoded["transcoded"], transcoded["failed"], up["upload"]["uploaded"]) == (8, 0, 9)
    assert transcoded["bytes_out"] < transcoded["bytes_in"]
    assert pulled["pull"]["files_in_dest"] == 9

    copy = staging.transcoded_cache(src.resolve(), 64, 80)
    remote = remote_md5s(cluster, "small/")
    assert remote.pop("dataset.json")
    assert remote == {p.relative_to(copy).as_posix(): md5_b64(p) for p in copy.rglob("*.JPEG")}
    dest = Path(cluster.data_path) / "small"
    for path in src.rglob("*.JPEG"):
        with Image.open(dest / path.relative_to(src)) as img:
            assert (img.format, img.size) == ("JPEG", (64, 64))
    manifest = json.loads((dest / "dataset.json").read_text())
    assert manifest.pop("created_at")
    assert manifest == {"short_side": 64, "quality": 80, "source": str(src.resolve()), "images": 8}

    again = run_module(*argv, "--no-progress", env={"CLUSTER_DESCRIPTION": str(cluster_file)}, timeout=120)
    up = json.loads(again.stdout.splitlines()[0])["upload"]
    assert (up["transcoded"]["skipped"], up["uploaded"], up["skipped"]) == (8, 0, 9)  # nothing done twice


def test_a_transcoded_upload_in_shards_keeps_dataset_json_beside_them(cluster, tmp_path):
    src = tmp_path / "src"
    staging.generate_synthetic_imagenet(src, classes=3, train_per_class=6, val_per_class=2, image_size=32)
    (src / "dataset.json").write_text('{"license": "synthetic"}')  # the source's own manifest is extended
    summary = staging.upload(
        cluster.data, cluster.staging_credential, src, "small-sharded", shard_size_mb=0.005,
        shard_dir=tmp_path / "shards", short_side=64, show_progress=False,
    )  # fmt: skip
    assert summary.transcoded is not None and summary.transcoded.transcoded == 24
    assert (summary.source_files, summary.failed) == (25, 0)
    pulled = staging.pull(cluster, "small-sharded", expected_files=25, expected_objects=summary.objects)
    assert pulled.raw["unpacked_files"] == 24
    manifest = json.loads((Path(cluster.data_path) / "small-sharded" / "dataset.json").read_text())
    assert (manifest["license"], manifest["short_side"], manifest["quality"], manifest["images"]) == (
        "synthetic", 64, 90, 24,
    )  # fmt: skip
