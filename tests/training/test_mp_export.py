"""What a model-parallel run leaves behind: the whole model gathered from its shards and stages into
one export, TensorBoard curves with memory per rank, and ``summary.png``.

The export of a sharded or pipelined run must be the model that one process trains from the same
weights on the same batches (tests/training/test_mp_equivalence.py shows their losses agree); the
ResNet export must be one ``training.predict`` scores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.training.jobs import run, torchrun
from tests.training.test_curves import check_summary_png, event_files, read_scalars
from tests.training.test_export_predict import run_predict
from training.config.models import GPT_CONFIGS
from training.model_parallel import METRIC_KEYS
from training.run.curves import FINAL_TOKENS_PER_SEC, LOSS, LR, MEMORY_GIB, TOKENS_PER_SEC
from training.run.metrics import validate_metrics
from training.torch.transformer import build_gpt

STEPS = 4
SEQ_LEN = 32
GPT = ["--model", "gpt-tiny", "--seq-len", SEQ_LEN, "--steps", STEPS, "--lr", "3e-3", "--seed", 3]
# The layouts sum in other orders than one process (see test_mp_equivalence); AdamW's g/sqrt(v)
# magnifies the last-bit differences of small gradients. Measured: at most 0.2% of what training
# moved a tensor; a tensor gathered from the wrong shards or stage would be off by all of it.
RELATIVE_TO_UPDATE = 0.02


def train(tmp: Path, name: str, nproc: int, *flags: Any) -> Path:
    """Run the job with every output; its run directory."""
    out = tmp / name
    outputs = [
        "--export-dir", out / "model", "--tensorboard-dir", out / "tb", "--summary-png", out / "summary.png",
        "--metrics-json", out / "metrics.json",
    ]  # fmt: skip
    run(torchrun(nproc, *flags, *outputs, module="training.model_parallel"), tmp / f"{name}.log", timeout=240)
    validate_metrics(json.loads((out / "metrics.json").read_text()), METRIC_KEYS)
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("one"), "one", 1, *GPT, "--batch-size", 8)


@pytest.mark.parametrize(
    ("name", "nproc", "flags"),
    [
        ("fsdp-2-x-pp-2", 4, ["--pp", 2, "--batch-size", 4, "--log-every", 2]),
        ("tp-2", 2, ["--tp", 2, "--batch-size", 8, "--log-every", 3]),
    ],
)
def test_the_export_is_the_whole_model_one_process_trains(
    one_process: Path, tmp_path: Path, name: str, nproc: int, flags: list[Any]
) -> None:
    out = train(tmp_path, name, nproc, *GPT, *flags)
    card = json.loads((out / "model" / "model.json").read_text())
    assert card["task"] == "causal-lm" and card["model"] == "gpt-tiny" and card["seq_len"] == SEQ_LEN
    assert card["config"]["n_layers"] == GPT_CONFIGS["gpt-tiny"].n_layers
    assert card["metrics"]["world_size"] == nproc

    expected = torch.export.load(one_process / "model" / "model.pt2").state_dict
    gathered = torch.export.load(out / "model" / "model.pt2").state_dict
    assert sorted(gathered) == sorted(expected)  # every stage's and shard's tensors, under the model's names
    initial = build_gpt(GPT_CONFIGS["gpt-tiny"], 3).state_dict()
    for key, tensor in expected.items():
        assert gathered[key].shape == tensor.shape, key
        moved = (tensor - initial[key]).abs().max().item()
        assert moved > 1e-4, key  # training changed every tensor
        assert (gathered[key] - tensor).abs().max().item() <= RELATIVE_TO_UPDATE * moved, key

    # model.pt2 computes what the state dict does, for another batch size than the one it was traced with.
    model = build_gpt(GPT_CONFIGS["gpt-tiny"], 0)
    model.load_state_dict(gathered)
    tokens = torch.randint(0, 256, (3, SEQ_LEN))
    program = torch.export.load(out / "model" / "model.pt2").module()
    with torch.no_grad():
        torch.testing.assert_close(program(tokens), model.eval()(tokens))


def test_curves_show_loss_tokens_per_second_and_memory_of_every_rank(tmp_path: Path) -> None:
    out = train(tmp_path, "curves", 4, *GPT, "--pp", 2, "--batch-size", 4, "--log-every", 2, "--timing-warmup-steps", 1)
    [events] = event_files(out / "tb")  # rank 0 alone writes
    scalars = read_scalars(events.parent)
    memory = [MEMORY_GIB.format(rank=rank) for rank in range(4)]
    assert {LOSS, LR, TOKENS_PER_SEC, FINAL_TOKENS_PER_SEC, *memory} <= scalars.keys()
    metrics = json.loads((out / "metrics.json").read_text())
    assert scalars[LOSS] == [(step, pytest.approx(loss)) for step, loss in metrics["step_losses"]]
    assert [step for step, _ in scalars[TOKENS_PER_SEC]] == [2, 4]  # from the first log step after warmup
    assert scalars[FINAL_TOKENS_PER_SEC] == [(STEPS, pytest.approx(metrics["tokens_per_sec"]))]
    for rank, tag in enumerate(memory):
        # the curve is the peak so far at each logged step; on CPU that is RSS, which may still grow a
        # little between the last logged step and the final figure
        final_peak_gib = metrics["peak_memory_bytes_per_rank"][rank] / 2**30
        assert final_peak_gib * 0.95 <= scalars[tag][-1][1] <= final_peak_gib
    check_summary_png(out / "summary.png")


def write_images(folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = folder / f"image_{i}.png"
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def test_a_pipelined_resnet_export_is_scored_by_predict(tmp_path: Path) -> None:
    flags = ["--model", "resnet_tiny", "--image-size", 32, "--num-classes", 3, "--batch-size", 4, "--steps", 2]
    out = train(tmp_path, "resnet", 2, *flags, "--pp", 2, "--dp-shard", 1)
    images = write_images(tmp_path / "images", 3)
    scored = run_predict(tmp_path, "--model", out / "model", "--json", "--top-k", 3, *images)
    assert scored.returncode == 0, scored.stderr
    predictions = json.loads(scored.stdout)["predictions"]
    assert len(predictions) == 3
    for prediction in predictions:
        assert sorted(entry["class"] for entry in prediction["top_k"]) == ["class_0", "class_1", "class_2"]
        assert sum(entry["probability"] for entry in prediction["top_k"]) == pytest.approx(1.0, abs=1e-4)


def test_predict_refuses_a_language_model_with_a_clear_error(one_process: Path, tmp_path: Path) -> None:
    [image] = write_images(tmp_path / "images", 1)
    refused = run_predict(tmp_path, "--model", one_process / "model", image)
    assert refused.returncode == 2
    assert "causal-lm export (gpt-tiny)" in refused.stderr and "image classifiers" in refused.stderr
    assert "Traceback" not in refused.stderr
