"""Model export and ``training.predict``: each framework trains resnet_tiny under horovodrun on
images whose classes differ by colour, exports, and a fresh ``python -m training.predict``
process classifies held-out images from the export alone. Unit tests cover the export directory,
predict's refusals and blob URLs."""

from __future__ import annotations

import contextlib
import csv
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import numpy as np
import pytest
from PIL import Image

from tests.local_http import serving
from tests.training.jobs import REPO, horovodrun, job_env, read_metrics, run
from training import predict
from training.config.settings import parse_settings
from training.data.imagenet import MEAN, STD, DataPlan, decode_val
from training.data.images import NOT_AN_IMAGE
from training.errors import OutputPathError
from training.run import export
from training.run.outputs import MODEL_JSON, check_output_paths

COLOURS = {"blue": (40, 60, 200), "green": (40, 170, 60), "red": (210, 40, 40)}  # sorted: label order
CHANCE = 1 / len(COLOURS)
GOOD = 0.8  # top-1 that a model which learned the colours reaches; chance is a third
TRAIN = ["--model", "resnet_tiny", "--image-size", "32", "--batch-size", "6", "--data-workers", "1"]
SCHEDULE = ["--epochs", "3", "--warmup-epochs", "0", "--lr", "0.05", "--log-every", "6"]
RUN_ID = "run-20260101-000000-abcd"


def write_images(folder: Path, per_class: int, seed: int, by_class: bool) -> None:
    """JPEGs of each colour with noise, of varied sizes; in a folder per class, or all in one folder
    named ``<class>_<i>.jpg``."""
    rng = np.random.default_rng(seed)
    for name, rgb in COLOURS.items():
        target = folder / name if by_class else folder
        target.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            height, width = rng.integers(34, 64, size=2)
            pixels = np.array(rgb) * rng.uniform(0.75, 1.15) + rng.normal(0, 30, (height, width, 3))
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(target / f"{name}_{i}.jpg", quality=90)


@pytest.fixture(scope="module")
def colours(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(data directory with train/ and val/, held-out images in one folder)``."""
    root = tmp_path_factory.mktemp("colours")
    write_images(root / "data" / "train", per_class=24, seed=1, by_class=True)
    write_images(root / "data" / "val", per_class=6, seed=2, by_class=True)
    write_images(root / "heldout", per_class=8, seed=3, by_class=False)
    return root / "data", root / "heldout"


def train(framework: str, data: Path, tmp_path: Path, *extra: Any) -> tuple[dict[str, Any], Path, str]:
    """Train on ``data`` with 2 workers and ``--export-dir``: ``(metrics, export directory, output)``."""
    model_dir, metrics_path = tmp_path / "run" / "model", tmp_path / "metrics.json"
    flags = [*TRAIN, *SCHEDULE, "--data", "imagenet", "--data-dir", data, "--export-dir", model_dir, *extra]
    cmd = horovodrun(2, framework, *flags, "--metrics-json", metrics_path)
    output = run(cmd, tmp_path / "job.log", timeout=180, env={"RUN_ID": RUN_ID, "GIT_REVISION": ""})
    metrics = read_metrics(metrics_path)
    assert metrics["val_top1"] >= GOOD, output[-3000:]
    return metrics, model_dir, output


PREDICT_HANG_S = 600


def run_predict(cwd: Path, *args: Any) -> subprocess.CompletedProcess[str]:
    """``python -m training.predict`` in a fresh process, with Python's import log on stderr."""
    cmd = [sys.executable, "-X", "importtime", "-m", "training.predict", *map(str, args)]
    # a guard against a hang, not a speed bound: importing TensorFlow alone took over 120 s at load 20
    return subprocess.run(cmd, cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=PREDICT_HANG_S)


def imported(stderr: str, package: str) -> bool:
    return re.search(rf"\|\s+{package}$", stderr, flags=re.MULTILINE) is not None


def check_model_card(card: dict[str, Any], framework: str, metrics: dict[str, Any], model_dir: Path) -> None:
    assert card["schema_version"] == export.SCHEMA_VERSION
    assert (card["framework"], card["model"], card["image_size"]) == (framework, "resnet_tiny", 32)
    assert card["classes"] == list(COLOURS)
    assert (model_dir / card["file"]).exists()
    expected = ("torch.export", "logits") if framework == "pytorch" else ("saved_model", "probabilities")
    assert (card["format"], card["outputs"]) == expected
    assert card["preprocessing"] == export.preprocessing(32)
    assert card["preprocessing"]["resize_short_side"] == pytest.approx(36.571, abs=1e-3)
    assert (card["preprocessing"]["mean"], card["preprocessing"]["std"]) == (list(MEAN), list(STD))
    assert card["metrics"] == metrics
    assert card["run_id"] == RUN_ID
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert card["git_revision"] == head.stdout.strip()  # GIT_REVISION empty: the checkout's HEAD
    created = datetime.strptime(card["created_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert timedelta(0) <= datetime.now(UTC) - created < timedelta(minutes=5)


def check_predictions(framework: str, model_dir: Path, heldout: Path, cwd: Path) -> None:
    """A fresh process scores the held-out folder from the export: JSON on stdout, and the CSV
    that a directory gets by default."""
    result = run_predict(cwd, "--model", model_dir, "--json", "--top-k", 2, heldout)
    assert result.returncode == 0, result.stderr[-3000:]
    other = "tensorflow" if framework == "pytorch" else "torch"
    assert not imported(result.stderr, other), f"loading a {framework} export imported {other}"
    document = json.loads(result.stdout)
    assert document["model"]["framework"] == framework and document["model"]["run_id"] == RUN_ID
    predictions = document["predictions"]
    assert len(predictions) == len(COLOURS) * 8
    hits = [p["top_k"][0]["class"] == Path(p["path"]).name.split("_")[0] for p in predictions]
    assert sum(hits) / len(hits) >= GOOD > CHANCE
    for p in predictions:
        assert len(p["top_k"]) == 2 and p["top_k"][0]["probability"] >= p["top_k"][1]["probability"]
    with open(cwd / "predictions.csv", newline="") as table:
        rows = list(csv.DictReader(table))
    assert [row["path"] for row in rows] == [p["path"] for p in predictions]
    assert list(rows[0]) == ["path", "top1_class", "top1_probability", "top2_class", "top2_probability"]
    for row, p in zip(rows, predictions, strict=True):
        assert row["top1_class"] == p["top_k"][0]["class"]
        assert float(row["top1_probability"]) == pytest.approx(p["top_k"][0]["probability"], abs=1e-6)


def test_pytorch_exports_every_epoch_and_predicts(colours: tuple[Path, Path], tmp_path: Path) -> None:
    data, heldout = colours
    model_dir = tmp_path / "run" / "model"
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:  # the export of epoch 1 is replaced by later ones: look while the job runs
        while not done.is_set():
            # Not there yet, or between an old export and its replacement: look again.
            with contextlib.suppress(OSError, ValueError):
                seen.add(json.loads((model_dir / MODEL_JSON).read_text())["metrics"]["epochs"])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        metrics, model_dir, output = train("pytorch", data, tmp_path, "--export-every-epoch")
    finally:
        done.set()
        watcher.join()
    assert {1, 3} <= seen, seen
    exports = re.findall(r"exported the model after step (\d+) to", output)
    assert exports == ["6", "12", "18"]  # epochs 1 and 2, then the end: the last epoch is not exported twice
    assert sorted(p.name for p in model_dir.parent.iterdir()) == ["model"]  # no staging left behind
    assert sorted(p.name for p in model_dir.iterdir()) == ["model.json", "model.pt2"]  # one copy of the weights
    card = json.loads((model_dir / MODEL_JSON).read_text())
    check_model_card(card, "pytorch", metrics, model_dir)
    assert card["files"] == {}
    check_predictions("pytorch", model_dir, heldout, tmp_path)

    one = heldout / "red_0.jpg"
    text = run_predict(tmp_path, "--model", model_dir, one)
    assert text.returncode == 0, text.stderr[-3000:]
    lines = text.stdout.splitlines()
    assert lines[0] == str(one) and len(lines) == 1 + len(COLOURS)  # top-5 of 3 classes: all 3
    assert re.fullmatch(r"  red [01]\.\d{4}", lines[1]), lines


@pytest.mark.parametrize("framework", ["tensorflow", "keras"])
def test_tensorflow_and_keras_export_and_predict(colours: tuple[Path, Path], tmp_path: Path, framework: str) -> None:
    data, heldout = colours
    metrics, model_dir, output = train(framework, data, tmp_path)
    assert output.count("exported the model after step") == 1  # at the end only
    assert sorted(p.name for p in model_dir.iterdir()) == ["model.json", "saved_model"]
    check_model_card(json.loads((model_dir / MODEL_JSON).read_text()), framework, metrics, model_dir)
    check_predictions(framework, model_dir, heldout, tmp_path)


# --- units ---------------------------------------------------------------------------------------


def write_torch_export(directory: Path, name: str, image_size: int) -> Any:
    """Export an untrained torch model as a run would (channels-last, as DDP leaves it); return the model."""
    import torch

    from training.pytorch import export_model
    from training.torch.models import build_model

    model = build_model(name, len(COLOURS)).to(memory_format=torch.channels_last)
    spec = export.ExportSpec("pytorch", name, list(COLOURS), image_size)
    save = lambda staging: export_model(model, image_size, staging)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export.write_export(directory, save, lambda files: export.model_card(spec, files, {"steps": 0}))
    assert not [w for w in caught if "complete tensor" in str(w.message)]  # torch.export.save's layout warning
    return model


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained simple_cnn export: enough for predict's refusals."""
    directory = tmp_path_factory.mktemp("tiny") / "model"
    write_torch_export(directory, "simple_cnn", 16)
    return directory


@pytest.mark.parametrize("name", ["resnet50", "resnet_tiny", "simple_cnn"])
def test_every_torch_model_exports_and_predict_computes_what_the_model_does(tmp_path: Path, name: str) -> None:
    import torch

    model = write_torch_export(tmp_path / "model", name, 32)
    assert model.training  # the model in training keeps its mode: the export is taken from a copy
    _, classify = predict.load_export(tmp_path / "model", "the export")
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    with torch.no_grad():
        expected = model.eval()(torch.from_numpy(images)).softmax(1).numpy()
    for batch in (images, images[:1]):  # the batch dimension is dynamic
        np.testing.assert_allclose(classify(batch), expected[: len(batch)], atol=1e-5)
    state = torch.export.load(tmp_path / "model" / "model.pt2").state_dict  # the weights, for fine-tuning
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[key], tensor.float()) for key, tensor in model.state_dict().items())


def test_an_export_replaces_the_previous_one_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    spec = export.ExportSpec("pytorch", "simple_cnn", ["a"], 8)

    def saver(content: str) -> export.Saver:
        def save(staging: Path) -> export.ModelFiles:
            (staging / "weights").write_text(content)
            return export.ModelFiles("torch.export", "weights", "logits")

        return save

    def failing(staging: Path) -> export.ModelFiles:
        (staging / "weights").write_text("half")
        raise OSError(28, "No space left on device")

    def describe(files: export.ModelFiles) -> dict[str, Any]:
        return export.model_card(spec, files, {})

    (tmp_path / ".model.tmp-12345").mkdir()  # an export interrupted by a killed run
    export.write_export(directory, saver("epoch 1"), describe)
    export.write_export(directory, saver("epoch 2"), describe)
    with pytest.raises(OSError, match="No space left"):
        export.write_export(directory, failing, describe)
    assert (directory / "weights").read_text() == "epoch 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert export.read_model_card(directory)["file"] == "weights"


def test_an_export_never_replaces_a_directory_that_is_not_one(tmp_path: Path) -> None:
    (tmp_path / "mine" / "notes.txt").parent.mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    (tmp_path / "file").write_text("x")
    (tmp_path / "earlier" / MODEL_JSON).parent.mkdir()
    (tmp_path / "earlier" / MODEL_JSON).write_text("{}")
    (tmp_path / "empty").mkdir()

    def check(*flags: Any) -> None:
        check_output_paths(parse_settings("pytorch", [str(flag) for flag in flags]), {"TRAINING_MIN_FREE_MB": "0"})

    with pytest.raises(OutputPathError, match=r"^--export-dir .*/mine: it holds files but no model.json"):
        check("--export-dir", tmp_path / "mine")
    with pytest.raises(
        OutputPathError, match=r"^cannot write --export-dir .*/file/model: a part of the path is a file"
    ):
        check("--export-dir", tmp_path / "file" / "model")
    for fine in ("earlier", "empty", "new"):
        check("--export-dir", tmp_path / fine, "--export-every-epoch")
    with pytest.raises(OutputPathError, match=r"it holds files but no model\.json"):
        export.write_export(tmp_path / "mine", lambda staging: export.ModelFiles("x", "x", "logits"), lambda f: {})
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


class Rank:
    """The collectives of one rank of two, as the exporter sees them."""

    def __init__(self, rank: int) -> None:
        self.rank, self.size, self.gathered = rank, 2, 0

    def allgather_object(self, obj: Any) -> list[Any]:
        self.gathered += 1
        return [obj, obj]


def test_rank_0_alone_writes_the_export_and_every_rank_waits_for_it(tmp_path: Path) -> None:
    settings = parse_settings("keras", ["--export-dir", str(tmp_path / "model"), "--epochs", "3"])
    spec = export.ExportSpec("keras", "simple_cnn", ["a"], 8)
    written: list[int] = []

    def save(staging: Path) -> export.ModelFiles:
        written.append(1)
        return export.ModelFiles("saved_model", "saved_model", "probabilities")

    for rank in (1, 0):
        dist = Rank(rank)
        exporter = export.Exporter(settings, dist, spec, save)
        assert exporter.epoch_hook is None  # no --export-every-epoch
        exporter.final({"steps": 30})
        assert (len(written), dist.gathered) == (int(rank == 0), 1)
    assert export.read_model_card(tmp_path / "model")["metrics"] == {"steps": 30}


def test_export_every_epoch_needs_an_export_dir(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings("keras", ["--export-every-epoch"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("error: --export-every-epoch needs --export-dir (see ")


def test_model_card_names_every_class_and_where_the_model_came_from(tmp_path: Path) -> None:
    settings = parse_settings("pytorch", ["--model", "resnet_tiny", "--image-size", "64", "--num-classes", "3"])
    spec = export.ExportSpec.of(settings, DataPlan(None, None, 3, 1, 1))
    assert spec.classes == ["class_0", "class_1", "class_2"]  # synthetic data has no names
    files = export.ModelFiles("torch.export", "model.pt2", "logits")
    card = export.model_card(spec, files, {"val_top1": 0.5}, {"RUN_ID": "r1", "GIT_REVISION": "abc123"})
    assert (card["run_id"], card["git_revision"], card["image_size"]) == ("r1", "abc123", 64)
    assert card["metrics"] == {"val_top1": 0.5}
    assert export.model_card(spec, files, {}, {})["run_id"] is None
    assert export.git_revision({}, root=tmp_path) is None  # not a checkout: an image
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert export.git_revision({}, root=REPO) == head.stdout.strip()


def test_predict_applies_the_validation_preprocessing(tiny_export: Path, tmp_path: Path) -> None:
    # A wide image whose left and right thirds differ: the center crop sees only the middle.
    pixels = np.zeros((40, 120, 3), dtype=np.uint8)
    pixels[:, 40:80] = (0, 200, 0)
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    seen: list[np.ndarray] = []

    def classify(images: np.ndarray) -> np.ndarray:
        seen.append(images)
        return np.tile([0.2, 0.7, 0.1], (len(images), 1))

    card = export.read_model_card(tiny_export)
    [result] = predict.predict(classify, card, [tmp_path / "wide.png"], top_k=2)
    assert result.top == [("green", 0.7), ("blue", 0.2)]
    np.testing.assert_array_equal(seen[0][0], decode_val(str(tmp_path / "wide.png"), 16))
    assert seen[0].shape == (1, 16, 16, 3) and seen[0].dtype == np.uint8


def refusal(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str]:
    """predict's exit status and its one error line, which must be the whole of stderr."""
    code = predict.run([str(arg) for arg in argv], env={})
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return code, err.strip()


def test_predict_refuses_bad_input_in_one_line(
    tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = tmp_path / "ok.jpg"
    Image.new("RGB", (20, 20), "red").save(image)
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG")
    (tmp_path / "notes.jpg").write_text("not an image at all\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "not-an-export").mkdir()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / MODEL_JSON).write_text("{not json")
    future = tmp_path / "future"
    future.mkdir()
    card = json.loads((tiny_export / MODEL_JSON).read_text())
    (future / MODEL_JSON).write_text(json.dumps({**card, "format": "onnx"}))
    cases = {
        (tmp_path / "none", image): f"error: model directory {tmp_path / 'none'} does not exist",
        (image, image): f"error: model directory {image} is a file: pass the export directory",
        (tmp_path / "not-an-export", image): f"error: {tmp_path / 'not-an-export'} has no model.json: pass an",
        (damaged, image): f"error: {damaged}: model.json is not readable as an export's (Expecting",
        (future, image): f"error: {future}: format 'onnx' is not one this version reads (torch.export, saved_model)",
        (tiny_export, tmp_path / "missing.jpg"): f"error: {tmp_path / 'missing.jpg'} does not exist",
        (tiny_export, tmp_path / "empty"): f"error: {tmp_path / 'empty'} holds no images (.jpeg, .jpg, .png)",
        (tiny_export, tmp_path / "broken.jpg"): f"error: cannot read image {tmp_path / 'broken.jpg'}: ",
        # the whole line: Pillow's own names its buffer (<_io.BytesIO object at 0x...>), not the file
        (tiny_export, tmp_path / "notes.jpg"): f"error: cannot read image {tmp_path / 'notes.jpg'}: {NOT_AN_IMAGE}",
    }
    for (model, target), expected in cases.items():
        code, line = refusal(capsys, "--model", model, target)
        assert (code, line[: len(expected)]) == (2, expected), line
    code, line = refusal(capsys, "--model", tiny_export, "--sas-file", image, image)
    assert (code, line) == (2, "error: --sas-file is only used when --model is a blob URL")
    code, line = refusal(capsys, "--model", tiny_export, "--csv", tmp_path / "ok.jpg" / "out.csv", image)
    assert code == 2 and line.startswith(f"error: cannot write --csv {tmp_path / 'ok.jpg' / 'out.csv'}: ")
    code, line = refusal(capsys, "--model", tiny_export, "--top-k", "0", image)
    assert (code, line[:59]) == (2, "error: argument --top-k: must be a positive integer, got 0 ")


def test_a_damaged_model_card_is_refused_before_any_image_is_decoded(
    tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # OpenCV and the crop arithmetic took these for sizes: a traceback, exit 1 (or an allocation of 3 TB)
    image = tmp_path / "ok.jpg"
    Image.new("RGB", (20, 20), "red").save(image)
    card = json.loads((tiny_export / MODEL_JSON).read_text())
    changes = {"x": "image_size 'x' is not", 0: "image_size 0 is not", -4: "image_size -4 is not", 10**6: "image_size"}
    for value, expected in {**changes, "empty": "classes is not a non-empty list"}.items():
        damaged = tmp_path / f"card-{value}"
        shutil.copytree(tiny_export, damaged)
        change = {"classes": []} if value == "empty" else {"image_size": value}
        (damaged / MODEL_JSON).write_text(json.dumps({**card, **change}))
        code, line = refusal(capsys, "--model", damaged, image)
        assert code == 2 and f"model.json is not readable as an export's ({expected}" in line, line


def test_predict_json_prints_an_error_document_on_failure(
    tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = tmp_path / "ok.jpg"
    Image.new("RGB", (20, 20), "red").save(image)
    (tmp_path / "notes.jpg").write_text("not an image at all\n")
    failures = [
        ("--model", tmp_path / "none", image),  # a bad model path
        ("--model", tiny_export, tmp_path / "notes.jpg"),  # bad input
        ("--model", tiny_export, "--top-k", "x", image),  # a bad flag, refused by the parser
    ]
    for argv in failures:
        code = predict.run(["--json", *map(str, argv)], env={})
        captured = capsys.readouterr()
        document = json.loads(captured.out)  # one document, the whole of stdout
        message = captured.err.removeprefix("error: ").strip()
        assert document == {"error": {"message": message, "exit_status": 2}} and code == 2, captured


@pytest.mark.parametrize(
    ("url", "container_url", "prefix"),
    [
        (
            "https://acct.blob.core.windows.net/results/run-1/model",
            "https://acct.blob.core.windows.net/results",
            "run-1/model",
        ),
        (
            "http://127.0.0.1:10000/devstoreaccount1/results/run-1/model/",
            "http://127.0.0.1:10000/devstoreaccount1/results",
            "run-1/model",
        ),
        ("https://acct.blob.core.windows.net/results", "https://acct.blob.core.windows.net/results", ""),
        ("http://azurite:10000/devstoreaccount1/c/a%20b/model", "http://azurite:10000/devstoreaccount1/c", "a b/model"),
    ],
)
def test_blob_urls_name_a_container_and_a_prefix(url: str, container_url: str, prefix: str) -> None:
    location = predict.parse_blob_url(url, env={})
    assert (location.container_url, location.prefix, location.sas) == (container_url, prefix, None)


def test_the_sas_comes_from_the_file_then_the_url_then_the_environment(tmp_path: Path) -> None:
    url = "https://acct.blob.core.windows.net/results/run-1/model"
    env = {predict.SAS_ENV: "sv=env&sig=ENV"}
    (tmp_path / "read.sas").write_text("?sv=file&sig=FILE\n")
    assert predict.parse_blob_url(url, tmp_path / "read.sas", env).sas == "sv=file&sig=FILE"
    assert predict.parse_blob_url(url + "?sv=url&sig=URL", None, env).sas == "sv=url&sig=URL"
    assert predict.parse_blob_url(url, None, env).sas == "sv=env&sig=ENV"
    location = predict.parse_blob_url(url + "?sv=url&sig=URL", None, {})
    assert "URL" not in str(location) + repr(location)  # the SAS is never shown
    with pytest.raises(predict.BadInput, match=r"the URL's query is not a SAS token \(it has no sig= part\)"):
        predict.parse_blob_url(url + "?comp=list", None, {})
    with pytest.raises(predict.BadInput, match=r"^cannot read --sas-file .*/none.sas: no such file or directory$"):
        predict.parse_blob_url(url, tmp_path / "none.sas", {})
    for bad in ("https://acct.blob.core.windows.net/", "http://127.0.0.1:10000/devstoreaccount1"):
        with pytest.raises(predict.BadInput, match="names no container"):
            predict.parse_blob_url(bad, None, {})


class RefusingStorage(http.server.BaseHTTPRequestHandler):
    """Answers every request as blob storage does when a SAS is refused or a container is missing."""

    answers: ClassVar[dict[str, tuple[int, str]]] = {
        "refused": (403, "AuthenticationFailed"),
        "missing": (404, "ContainerNotFound"),
    }
    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.requests.append(self.path)
        status, code = self.answers[urlsplit(self.path).path.split("/")[2]]
        body = f"<?xml version='1.0' encoding='utf-8'?><Error><Code>{code}</Code><Message>no</Message></Error>"
        self.send_response(status)
        self.send_header("x-ms-error-code", code)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def storage() -> Iterator[str]:
    with serving(RefusingStorage) as base:
        yield f"{base}/devstoreaccount1"


def test_refused_access_exits_3_and_a_missing_container_2_without_showing_the_sas(
    storage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = tmp_path / "ok.jpg"
    Image.new("RGB", (20, 20), "red").save(image)
    secret = "sv=2025-01-05&sr=c&sp=rl&sig=SECRETSIGNATURE"
    code, line = refusal(capsys, "--model", f"{storage}/refused/run-1/model?{secret}", image)
    assert code == 3
    assert line.startswith(f"error: access to {storage}/refused/run-1/model refused (HTTP 403 AuthenticationFailed)")
    assert "SECRETSIGNATURE" not in line
    assert "sig=SECRETSIGNATURE" in RefusingStorage.requests[0]  # it was sent, as the SAS query
    code, line = refusal(capsys, "--model", f"{storage}/missing/run-1/model", image)
    assert (code, line) == (
        2,
        f"error: {storage}/missing/run-1/model: not found (ContainerNotFound): check the account and container",
    )
