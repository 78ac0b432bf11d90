"""Classify images with a model that a training run exported (``--export-dir``, see :mod:`training.run.export`).

The export's model.json says how to load it and how to prepare an image: the decode, resize and
center crop of the jobs' validation (:func:`training.data.imagenet.decode_val`, reused here); the model
normalizes its uint8 input itself. Loading a PyTorch export imports no TensorFlow, and the reverse.
A blob URL of an export is downloaded to a temporary directory first, with a read SAS.

Errors are one ``error:`` line: exit 2 for bad input (a path, an image, a URL, a damaged export),
3 when blob storage cannot be reached or refuses access, or a package is missing.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import unquote, urlsplit

import numpy as np
from PIL import Image

from training.config.args import Parser, positive_int
from training.data.imagenet import IMAGE_SUFFIXES, decode_val
from training.errors import BadInput, ExitCode, JobError, NotReady, first_line
from training.run.export import IMAGE_CLASSIFICATION, read_model_card
from training.run.outputs import MODEL_JSON, output_error

SAS_ENV = "AZURE_STORAGE_SAS_TOKEN"
DEFAULT_CSV = Path("predictions.csv")
BATCH_SIZE = 32
PROGRESS_MIN_BYTES = 64 * 2**20  # a ResNet-50 export is about 200 MB; a resnet_tiny one, 1 MB
# https://<account>.blob.core.windows.net/...: the account is in the host name. Anything else
# (Azurite's http://127.0.0.1:10000/devstoreaccount1/..., other emulators) has it in the path.
_ACCOUNT_HOST = re.compile(r"^[a-z0-9]+\.blob\.")

Classifier = Callable[[np.ndarray], np.ndarray]  # uint8 NHWC images -> probabilities [N, classes]

EXAMPLES = f"""
examples:
  python -m training.predict --model runs/RUN_ID/model cat.jpg dog.jpg
  python -m training.predict --model runs/RUN_ID/model --json --top-k 3 cat.jpg
  python -m training.predict --model runs/RUN_ID/model --csv scores.csv photos/
  {SAS_ENV}='sv=...&sig=...' python -m training.predict \\
      --model https://ACCOUNT.blob.core.windows.net/results/RUN_ID/model cat.jpg
  python -m training.predict --sas-file read.sas \\
      --model http://127.0.0.1:10000/devstoreaccount1/results/RUN_ID/model cat.jpg

A directory is scored recursively ({", ".join(IMAGE_SUFFIXES)}) into a CSV: --csv OUT, or
{DEFAULT_CSV} in the current directory. Exit status: 0 done, 2 bad input, 3 storage unreachable
or access refused.
"""


@dataclass(frozen=True)
class BlobPrefix:
    """Where an export lies in blob storage. ``str()`` is the URL without its SAS."""

    container_url: str
    prefix: str  # "" or e.g. "RUN_ID/model", without slashes at either end
    sas: str | None = field(repr=False)

    def __str__(self) -> str:
        return f"{self.container_url}/{self.prefix}" if self.prefix else self.container_url


@dataclass(frozen=True)
class Prediction:
    path: str
    top: list[tuple[str, float]]  # (class, probability), most probable first


def parse_blob_url(url: str, sas_file: Path | None = None, env: Mapping[str, str] = os.environ) -> BlobPrefix:
    """``https://<account>.blob.core.windows.net/<container>/<prefix>`` or, for emulators such as
    Azurite, ``http://<host>:<port>/<account>/<container>/<prefix>``. The SAS comes from
    ``sas_file``, else the URL's query, else ``$AZURE_STORAGE_SAS_TOKEN``; none means anonymous."""
    parts = urlsplit(url)
    shown = f"{parts.scheme}://{parts.netloc}{parts.path}"  # never the query: it may hold a SAS
    segments = [segment for segment in parts.path.split("/") if segment]
    container_at = 0 if _ACCOUNT_HOST.match(parts.hostname or "") else 1
    if not parts.hostname or len(segments) <= container_at:
        raise BadInput(
            f"{shown} names no container: expected https://<account>.blob.core.windows.net/<container>/<run-id>/model"
            " (or http://<host>:<port>/<account>/<container>/... for an emulator)"
        )
    container_url = f"{parts.scheme}://{parts.netloc}/{'/'.join(segments[: container_at + 1])}"
    prefix = "/".join(unquote(segment) for segment in segments[container_at + 1 :])
    return BlobPrefix(container_url, prefix, _read_sas(parts.query, sas_file, env))


def _read_sas(query: str, sas_file: Path | None, env: Mapping[str, str]) -> str | None:
    if sas_file is not None:
        try:
            token, source = sas_file.read_text().strip(), f"--sas-file {sas_file}"
        except OSError as exc:
            raise BadInput(f"cannot read --sas-file {sas_file}: {(exc.strerror or str(exc)).lower()}") from None
    elif query:
        token, source = query, "the URL's query"
    else:
        token, source = env.get(SAS_ENV, "").strip(), f"${SAS_ENV}"
    token = token.lstrip("?")
    if token and "sig=" not in token:
        raise BadInput(f"{source} is not a SAS token (it has no sig= part): create one with read and list permissions")
    return token or None


def download(location: BlobPrefix, destination: Path) -> None:
    """Copy every blob under ``location`` into ``destination``; it must hold an export."""
    try:
        from azure.core.exceptions import AzureError
        from azure.storage.blob import ContainerClient, LinearRetry
    except ImportError:
        raise NotReady(
            "a blob URL needs the package azure-storage-blob: pip install azure-storage-blob==12.27.1"
        ) from None
    # A few quick retries: the SDK's default waits over a minute before it reports unreachable storage.
    retry = LinearRetry(backoff=2, random_jitter_range=1, retry_total=3)
    client = ContainerClient.from_container_url(
        location.container_url, credential=location.sas, retry_policy=retry, connection_timeout=20, read_timeout=120
    )
    start = f"{location.prefix}/" if location.prefix else ""
    try:
        listed = client.list_blobs(name_starts_with=start or None, include=["metadata"])
        # Hierarchical-namespace accounts list their directories as empty marker blobs.
        blobs = [blob for blob in listed if (blob.metadata or {}).get("hdi_isfolder") != "true"]
        if not any(blob.name == start + MODEL_JSON for blob in blobs):
            raise BadInput(
                f"no model export at {location}: there is no {MODEL_JSON} under it "
                "(pass the URL of a run's model/ directory, written by a run with --export-dir)"
            )
        with _progress(sum(blob.size for blob in blobs)) as advance:
            for blob in blobs:
                target = _inside(destination, blob.name[len(start) :], location)
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as out:
                    for chunk in client.download_blob(blob.name).chunks():
                        out.write(chunk)
                        advance(len(chunk))
    except AzureError as exc:
        raise _storage_error(exc, location) from None


def _inside(destination: Path, name: str, location: BlobPrefix) -> Path:
    """The local path of a blob, which must stay inside ``destination`` (no ``..`` in names)."""
    target = (destination / name).resolve()
    if not target.is_relative_to(destination.resolve()) or target == destination.resolve():
        raise BadInput(f"{location} holds a blob named {name!r}, which is not a file path inside the export")
    return target


def _storage_error(exc: Exception, location: BlobPrefix) -> JobError:
    from azure.core.exceptions import HttpResponseError, ResourceNotFoundError

    if not isinstance(exc, HttpResponseError):
        return NotReady(f"cannot reach blob storage for {location}: {_redact(first_line(exc), location.sas)}")
    code = getattr(exc.error_code, "value", exc.error_code) or exc.reason  # the SDK's enum, or the header's text
    if isinstance(exc, ResourceNotFoundError):
        return BadInput(f"{location}: not found ({code}): check the account and container")
    if exc.status_code in (401, 403):
        return NotReady(
            f"access to {location} refused (HTTP {exc.status_code} {code}): pass a SAS with read and list permissions "
            f"on the container (--sas-file, ${SAS_ENV} or the URL's query), and check that it has not expired"
        )
    return NotReady(f"blob storage answered HTTP {exc.status_code} {code} for {location}")


def _redact(text: str, sas: str | None) -> str:
    if sas:
        text = text.replace(sas, "<SAS>")
    return re.sub(r"sig=[^&\s]+", "sig=<redacted>", text)


@contextmanager
def _progress(total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr for a large download; nothing for a small one."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
    except ImportError:  # rich is in requirements-train.txt, not necessarily where predict runs
        total = 0
    if total < PROGRESS_MIN_BYTES:
        yield lambda n: None
        return
    columns = (TextColumn("downloading the model"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("download", total=total)
        yield lambda n: bar.advance(task, n)


@contextmanager
def export_directory(model: str, sas_file: Path | None, env: Mapping[str, str]) -> Iterator[tuple[Path, str]]:
    """The local directory of ``--model`` (the directory itself, or a download of the URL), and
    how to name the model in messages (never with a SAS)."""
    if model.startswith(("https://", "http://")):
        location = parse_blob_url(model, sas_file, env)
        with tempfile.TemporaryDirectory(prefix="predict-model-") as tmp:
            download(location, Path(tmp))
            yield Path(tmp), str(location)
        return
    if sas_file is not None:
        raise BadInput("--sas-file is only used when --model is a blob URL")
    directory = Path(model)
    if not directory.is_dir():
        state = "is a file: pass the export directory" if directory.exists() else "does not exist"
        raise BadInput(f"model directory {directory} {state}")
    if not (directory / MODEL_JSON).is_file():
        raise BadInput(
            f"{directory} has no {MODEL_JSON}: pass an export directory (a run's --export-dir: runs/<run-id>/model)"
        )
    yield directory, model


def load_export(directory: Path, source: str) -> tuple[dict[str, Any], Classifier]:
    """model.json and a classifier for the export in ``directory`` (``source`` names it in errors)."""
    try:
        card = read_model_card(directory)
    except (OSError, ValueError) as exc:
        raise BadInput(f"{source}: {MODEL_JSON} is not readable as an export's ({first_line(exc)})") from None
    task = card.get("task", IMAGE_CLASSIFICATION)
    if task != IMAGE_CLASSIFICATION:
        raise BadInput(
            f"{source}: a {task} export ({card.get('model')}); training.predict scores images with image classifiers"
        )
    loaders = {"torch.export": _torch_classifier, "saved_model": _tf_classifier}
    loader = loaders.get(card["format"])
    if loader is None:
        raise BadInput(f"{source}: format {card['format']!r} is not one this version reads ({', '.join(loaders)})")
    try:
        return card, loader(directory / card["file"], card["outputs"])
    except ImportError as exc:
        raise NotReady(f"a {card['framework']} export needs the package {exc.name}, which is not installed") from None
    except Exception as exc:  # a damaged or truncated file: the framework's own error says how
        raise BadInput(f"{source}: cannot load {card['file']} ({first_line(exc)})") from None


def _torch_classifier(path: Path, outputs: str) -> Classifier:
    import torch

    module = torch.export.load(path).module()

    def classify(images: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            result = module(torch.from_numpy(images))
        return (result.softmax(1) if outputs == "logits" else result).numpy()

    return classify


def _tf_classifier(path: Path, outputs: str) -> Classifier:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before the import: TensorFlow's start-up chatter
    import tensorflow as tf

    serve = tf.saved_model.load(str(path)).signatures["serving_default"]

    def classify(images: np.ndarray) -> np.ndarray:
        result = serve(images=tf.constant(images))[outputs]
        return (tf.nn.softmax(result) if outputs == "logits" else result).numpy()

    return classify


def find_images(inputs: Sequence[Path]) -> tuple[list[Path], bool]:
    """The images to score, in the order given (directories recursively, sorted), and whether
    a directory was among the inputs."""
    images: list[Path] = []
    for path in inputs:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise BadInput(f"{path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
            images += found
        elif path.is_file():
            images.append(path)
        else:
            raise BadInput(f"{path} does not exist")
    return images, any(path.is_dir() for path in inputs)


def predict(classify: Classifier, card: Mapping[str, Any], images: Sequence[Path], top_k: int) -> list[Prediction]:
    """Top-k classes of every image, scored in batches."""
    classes = [str(name) for name in card["classes"]]
    k = min(top_k, len(classes))
    predictions = []
    for start in range(0, len(images), BATCH_SIZE):
        chunk = images[start : start + BATCH_SIZE]
        probabilities = classify(np.stack([_decode(path, int(card["image_size"])) for path in chunk]))
        if probabilities.shape[1] != len(classes):
            raise BadInput(f"{MODEL_JSON} lists {len(classes)} classes, the model has {probabilities.shape[1]} outputs")
        for path, row in zip(chunk, probabilities, strict=True):
            best = np.argsort(-row, kind="stable")[:k]
            predictions.append(Prediction(str(path), [(classes[i], float(row[i])) for i in best]))
    return predictions


def _decode(path: Path, size: int) -> np.ndarray:
    try:
        return decode_val(str(path), size)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadInput(f"cannot read image {path}: {first_line(exc)}") from None


def write_csv(path: Path, predictions: Sequence[Prediction], k: int) -> None:
    header = ["path"] + [f"top{i}_{column}" for i in range(1, k + 1) for column in ("class", "probability")]
    try:
        with open(path, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(header)
            for p in predictions:
                writer.writerow([p.path, *(value for name, prob in p.top for value in (name, f"{prob:.6f}"))])
    except OSError as exc:
        raise output_error("--csv", path, exc) from None


def as_json(card: Mapping[str, Any], source: str, predictions: Sequence[Prediction]) -> str:
    model = {key: card.get(key) for key in ("framework", "model", "format", "run_id", "git_revision", "created_at")}
    return json.dumps(
        {
            "model": {"source": source, **model},
            "predictions": [
                {"path": p.path, "top_k": [{"class": name, "probability": prob} for name, prob in p.top]}
                for p in predictions
            ],
        },
        indent=2,
    )


def as_text(predictions: Sequence[Prediction]) -> str:
    return "\n".join(f"{p.path}\n" + "\n".join(f"  {name} {prob:.4f}" for name, prob in p.top) for p in predictions)


class _PredictParser(Parser):
    """A bad command line is BadInput (exit 2) like any other bad input, so that --json reports it too."""

    def error(self, message: str) -> NoReturn:
        raise BadInput(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _PredictParser(
        prog="python -m training.predict",
        description="Classify images with a model exported by a training run (--export-dir): "
        "print the top classes and their probabilities.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        required=True,
        help="an export directory (runs/<run-id>/model), or its blob URL "
        "(https://<account>.blob.core.windows.net/<container>/<run-id>/model)",
    )
    parser.add_argument("images", nargs="+", type=Path, metavar="IMAGE", help="image files or directories")
    parser.add_argument(
        "--top-k", type=positive_int, default=5, metavar="N", help="classes shown per image (default: 5)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument(
        "--csv",
        type=Path,
        metavar="OUT",
        help=f"write the predictions to this CSV (default for a directory: ./{DEFAULT_CSV})",
    )
    parser.add_argument(
        "--sas-file",
        type=Path,
        metavar="FILE",
        help=f"a file holding a read SAS for a blob URL (else the URL's query or ${SAS_ENV})",
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of every error")
    return parser


def run(argv: Sequence[str] | None = None, env: Mapping[str, str] = os.environ) -> int:
    """The command; returns its exit status. A failure is one `error:` line on stderr and, under
    --json, also a JSON document on stdout: {"error": {"message", "exit_status"}} (the operator
    CLI's error document, dtrain/json_documents.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    flags = argv[: argv.index("--")] if "--" in argv else argv  # after `--`: image paths
    json_out, debug = "--json" in flags, "--debug" in flags
    try:
        args = build_parser().parse_args(argv)
        images, has_directory = find_images(args.images)
        with export_directory(args.model, args.sas_file, env) as (directory, source):
            card, classify = load_export(directory, source)
            predictions = predict(classify, card, images, args.top_k)
        csv_path = args.csv or (DEFAULT_CSV if has_directory else None)
        if csv_path is not None:
            write_csv(csv_path, predictions, min(args.top_k, len(card["classes"])))
        if args.json:
            print(as_json(card, source, predictions))
        elif csv_path is not None:
            print(f"wrote {len(predictions)} predictions to {csv_path}")
        else:
            print(as_text(predictions))
        return ExitCode.OK
    except KeyboardInterrupt:
        return _fail("interrupted", ExitCode.INTERRUPTED, json_out)
    except JobError as exc:
        if debug:
            traceback.print_exception(exc)
        return _fail(str(exc), exc.exit_code, json_out)
    except Exception as exc:  # a bug: its traceback is the report
        traceback.print_exception(exc)
        return _fail(f"{type(exc).__name__}: {first_line(exc)}", ExitCode.FAILED, json_out)


def _fail(message: str, code: int, json_out: bool) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    if json_out:
        print(json.dumps({"error": {"message": message, "exit_status": int(code)}}, indent=2), flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> NoReturn:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
