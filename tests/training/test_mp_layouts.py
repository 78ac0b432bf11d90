"""Layouts of the model-parallel job: the flag arithmetic, the refusals (before any process group
starts), the mesh coordinates, and the transformer's shapes and parameter counts (on the meta
device: nothing is allocated, so llama-8b costs nothing)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.training.jobs import REPO, error_lines, job_env, run, torchrun
from training.config.activation_checkpointing import AC_MODES
from training.config.layout import MESH_DIMS, Layout, check_model
from training.config.models import GPT_CONFIGS, flops_per_token, parameter_count
from training.data.text import SyntheticTokens, TextCorpus, replica_rows
from training.errors import BadInput
from training.model_parallel import METRIC_KEYS, layout_of, parse_settings
from training.run.metrics import validate_metrics
from training.torch.parallel import memory
from training.torch.parallel.sharding import apply_activation_checkpointing
from training.torch.transformer import GPT, build_gpt

# A refusal needs Python and torch started, seconds here, more than a minute on a loaded machine; only a
# job that hangs comes near this.
START_BOUND_S = 300

# --- Layout arithmetic ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "tp", "pp", "dp_shard", "expected"),
    [
        (1, 1, 1, -1, Layout(1, 1, 1, 1)),
        (4, 1, 1, -1, Layout(dp_replicate=1, dp_shard=4)),  # -1: FSDP over every rank
        (4, 1, 1, 1, Layout(dp_replicate=4, dp_shard=1)),  # no sharding: all replicate
        (4, 2, 1, -1, Layout(dp_shard=2, tp=2)),
        (8, 2, 1, 2, Layout(dp_replicate=2, dp_shard=2, tp=2)),  # HSDP x TP
        (8, 2, 2, -1, Layout(dp_shard=2, tp=2, pp=2)),
        (6, 1, 3, 1, Layout(dp_replicate=2, pp=3)),
    ],
)
def test_layout_from_flags(world: int, tp: int, pp: int, dp_shard: int, expected: Layout) -> None:
    layout = Layout.from_flags(world, tp, pp, dp_shard)
    assert layout == expected
    assert layout.world_size == world
    assert layout.dp == layout.dp_replicate * layout.dp_shard


@pytest.mark.parametrize(
    ("world", "tp", "pp", "dp_shard", "message"),
    [
        (4, 3, 1, -1, "--tp 3 x --pp 1 = 3 does not divide the world size 4"),
        (4, 1, 3, -1, "--tp 1 x --pp 3 = 3 does not divide the world size 4"),
        (8, 2, 2, 3, "--tp 2 x --pp 2 x --dp-shard 3 = 12 does not divide the world size 8"),
        (4, 2, 1, 4, "--tp 2 x --pp 1 x --dp-shard 4 = 8 does not divide the world size 4"),
        (4, 1, 1, 0, "degrees are positive"),
    ],
)
def test_layout_refuses_degrees_that_do_not_divide_the_world(
    world: int, tp: int, pp: int, dp_shard: int, message: str
) -> None:
    with pytest.raises(BadInput, match=message):
        Layout.from_flags(world, tp, pp, dp_shard)


def test_coordinates_are_the_mesh_order() -> None:
    """init_device_mesh lays ranks out as arange(world).view(shape): coordinates must agree, and
    the data-parallel rank must number the replicas 0..dp-1 (each exactly tp x pp times)."""
    layout = Layout(dp_replicate=2, dp_shard=3, tp=2, pp=2)
    grid = np.arange(layout.world_size).reshape(layout.shape)
    replicas: dict[int, int] = {}
    for index in np.ndindex(*layout.shape):
        rank = int(grid[index])
        assert layout.coordinates(rank) == dict(zip(MESH_DIMS, index, strict=True))
        replicas[layout.dp_rank(rank)] = replicas.get(layout.dp_rank(rank), 0) + 1
    assert replicas == dict.fromkeys(range(layout.dp), layout.tp * layout.pp)


def test_check_model_refusals() -> None:
    with pytest.raises(BadInput, match=r"--tp 2: tensor parallelism .* resnet50"):
        check_model(Layout(tp=2, dp_shard=2), "resnet50", 16)
    with pytest.raises(BadInput, match="--pp 5 needs 5 pipeline stages but gpt-tiny has only 4 layers"):
        check_model(Layout(pp=5), "gpt-tiny", 4, 4, 2)
    with pytest.raises(BadInput, match=r"--pp 3 needs 6 pipeline stages \(2 per rank\)"):
        check_model(Layout(pp=3), "gpt-tiny", 4, 4, 2, stages_per_rank=2)
    with pytest.raises(BadInput, match="resnet_tiny has only 3 residual blocks"):
        check_model(Layout(pp=4), "resnet_tiny", 3)
    with pytest.raises(BadInput, match="--tp 4 does not divide gpt-tiny's 2 key/value heads"):
        check_model(Layout(tp=4), "gpt-tiny", 4, 4, 2)
    with pytest.raises(BadInput, match=re.escape("--tp 3 does not divide gpt-1.3b's 16 attention heads")):
        check_model(Layout(tp=3), "gpt-1.3b", 24, 16, 16)
    check_model(Layout(tp=8, pp=4), "llama-8b", 32, 32, 8)  # 8 KV heads: one per TP rank
    check_model(Layout(pp=4), "gpt-tiny", 4, 4, 2)  # one layer per stage is enough


# --- The job refuses bad layouts before any process group starts -----------------------------------


@pytest.mark.parametrize(
    ("world", "flags", "message"),
    [
        (4, ["--tp", "3"], "--tp 3 x --pp 1 = 3 does not divide the world size 4"),
        (4, ["--tp", "2", "--dp-shard", "3"], "--tp 2 x --pp 1 x --dp-shard 3 = 6 does not divide the world size 4"),
        (8, ["--pp", "8"], "--pp 8 needs 8 pipeline stages but gpt-tiny has only 4 layers"),
        (2, ["--model", "resnet50", "--tp", "2"], "--tp 2: tensor parallelism splits attention and MLP layers"),
        (4, ["--tp", "4"], "--tp 4 does not divide gpt-tiny's 2 key/value heads"),
        (6, ["--pp", "3", "--pp-schedule", "interleaved-1f1b"], "--pp 3 needs 6 pipeline stages (2 per rank)"),
        (2, ["--pp", "2", "--batch-size", "4", "--microbatches", "3"], "--batch-size 4 must be a multiple of"),
        # the PyTorch jobs' one parser: what only training.pytorch trains is refused here, as early
        (2, ["--model", "simple_cnn"], "--model simple_cnn: a mesh splits the transformers and ResNets"),
        (2, ["--precision", "amp"], "--precision amp: a mesh layout computes in bf16"),
    ],
)
def test_job_refuses_a_bad_layout_before_any_process_group(
    tmp_path: Path, world: int, flags: list[str], message: str
) -> None:
    """Rank 0 of a world that does not exist: had the job called init_process_group, it would wait
    for the other ranks at a rendezvous nobody serves, for its peer timeout (set here far beyond the
    test's bound), and could never print the layout's error. Exit 2 with that one error line shows the
    layout was refused first; the bound is only for a loaded machine's start of Python and torch."""
    env = job_env(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT="9", DDP_TIMEOUT_SECONDS="3600")  # discard: nothing listens
    cmd = [sys.executable, "-m", "training.model_parallel", "--model", "gpt-tiny", "--steps", "1", *flags]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=START_BOUND_S)
    assert done.returncode == 2, done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_job_refuses_to_run_without_torchrun() -> None:
    env = job_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "training.model_parallel", "--model", "gpt-tiny"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=START_BOUND_S)
    assert done.returncode == 2
    assert error_lines(done.stderr) == [
        "error: training.model_parallel runs under torchrun: torchrun --nproc-per-node N -m training.model_parallel ..."
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data", "text"], "--data text needs --data-dir"),
        (["--model", "gpt-tiny", "--data-dir", "/tmp"], "--data-dir is only used with --data text"),
        (["--model", "resnet_tiny", "--data", "text", "--data-dir", "/tmp"], "resnet_tiny trains on synthetic images"),
        (["--model", "gpt-tiny", "--seq-len", "257"], "--seq-len 257 is longer than gpt-tiny's context of 256"),
        (["--dp-shard", "-2"], "--dp-shard: must be a positive integer or -1 (every rank left), got '-2'"),
        (["--pp-schedule", "zb"], "invalid choice"),
    ],
)
def test_flag_refusals(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_flag_defaults() -> None:
    settings = parse_settings(["--model", "llama-8b", "--pp", "2", "--pp-schedule", "interleaved-1f1b"])
    assert (settings.seq_len, settings.parallel.microbatches, settings.parallel.dp_shard) == (2048, 4, None)
    assert layout_of(settings, 8).dp_shard == 4  # no --dp-shard: this job shards over every rank left (-1)
    settings = parse_settings(["--model", "gpt-tiny", "--pp", "4"])
    assert (settings.seq_len, settings.parallel.microbatches, settings.parallel.pp_schedule) == (256, 4, "1f1b")


def test_resnet_trains_in_a_pipeline_of_fsdp_stages(tmp_path: Path) -> None:
    """ResNets take FSDP and pipelines (not TP): stages split between residual blocks, each
    sharded over 2 ranks. Their activations are channels-last, which a stage must make contiguous
    before sending. (Not an equivalence test: batch norm's statistics are per microbatch.)"""
    metrics_path = tmp_path / "metrics.json"
    flags = ["--model", "resnet_tiny", "--image-size", 16, "--num-classes", 10, "--batch-size", 4, "--steps", 4]
    cmd = torchrun(
        4, *flags, "--pp", 2, "--log-every", 1, "--metrics-json", metrics_path, module="training.model_parallel"
    )
    run(cmd, tmp_path / "resnet.log", timeout=180)
    metrics = json.loads(metrics_path.read_text())
    validate_metrics(metrics, METRIC_KEYS)
    assert metrics["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2}
    assert (metrics["global_batch_size"], metrics["pp_schedule"], metrics["microbatches"]) == (8, "1f1b", 2)
    assert metrics["images_per_sec"] > 0 and metrics["tokens_per_sec"] is None and metrics["seq_len"] is None
    losses = [loss for _, loss in metrics["step_losses"]]
    assert len(losses) == 4 and losses[-1] < losses[0]  # one fixed batch: the loss must fall
    assert sum(metrics["parameters_per_rank"]) == metrics["parameters_total"]  # stages x shards: a partition


# --- The transformer ------------------------------------------------------------------------------

KNOWN_PARAMETERS = {
    "gpt-tiny": 180_800,
    "gpt-125m": 162_148_608,  # GPT-2 small's 124M + an untied output layer, without biases and positions
    "gpt-1.3b": 1_413_912_576,
    "llama-8b": 8_030_261_248,  # Meta's count for Llama 3 8B
}


@pytest.mark.parametrize("name", list(GPT_CONFIGS))
def test_transformer_shapes_and_parameter_counts(name: str) -> None:
    cfg = GPT_CONFIGS[name]
    model = build_gpt(cfg, seed=None)  # meta device
    assert all(param.is_meta for param in model.parameters())
    assert sum(param.numel() for param in model.parameters()) == parameter_count(cfg) == KNOWN_PARAMETERS[name]
    assert list(model.layers) == [str(i) for i in range(cfg.n_layers)]
    block = model.layers["0"]
    kv_dim = cfg.kv_heads * cfg.head_dim
    assert block.attention.wq.weight.shape == (cfg.dim, cfg.dim)
    assert block.attention.wk.weight.shape == block.attention.wv.weight.shape == (kv_dim, cfg.dim)
    assert block.feed_forward.w1.weight.shape == (cfg.ffn_dim, cfg.dim)
    assert (block.feed_forward.w3 is not None) == cfg.swiglu
    assert model.output is not None and model.output.weight.shape == (cfg.vocab_size, cfg.dim)
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    assert model(tokens).shape == (2, 16, cfg.vocab_size)
    assert flops_per_token(cfg, 2048) > 6 * (parameter_count(cfg) - cfg.vocab_size * cfg.dim)


def test_llama_8b_shapes() -> None:
    cfg = GPT_CONFIGS["llama-8b"]
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim, cfg.vocab_size) == (
        4096, 32, 32, 8, 14336, 128256
    )  # fmt: skip
    # 6N + attention at 8K context: the usual ~4.6e10 FLOPs per token.
    assert flops_per_token(cfg, 8192) == pytest.approx(6 * 7_504_924_672 + 12 * 32 * 4096 * 8192)


def test_transformer_init_is_deterministic_and_causal() -> None:
    cfg = GPT_CONFIGS["gpt-tiny"]
    a, b, c = build_gpt(cfg, 1), build_gpt(cfg, 1), build_gpt(cfg, 2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert pa.dim() == 1 or not torch.equal(pa, pc), name
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % cfg.vocab_size
    with torch.no_grad():
        before, after = a(tokens), a(changed)
    assert torch.equal(before[:, :8], after[:, :8])  # no position sees a later token
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_transformer_runs_as_pipeline_pieces() -> None:
    """Without tok_embeddings a GPT takes hidden states; without output it returns them: two
    pieces holding the two halves of the layers compose to the whole model."""
    cfg = GPT_CONFIGS["gpt-tiny"]
    whole = build_gpt(cfg, 3)
    first, second = build_gpt(cfg, 3), build_gpt(cfg, 3)
    first.norm = first.output = None
    second.tok_embeddings = None
    for key in ("0", "1"):
        del second.layers[key]
    for key in ("2", "3"):
        del first.layers[key]
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 10, cfg.dim)
        assert torch.allclose(second(hidden), whole(tokens), atol=1e-6)
    assert isinstance(second, GPT) and set(second.state_dict()) < set(whole.state_dict())


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (a recomputation shows up as ops of the forward in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_activation_checkpointing_recomputes_what_it_says() -> None:
    """In backward, ``full`` recomputes each block's forward (matmuls, attention and all), and
    ``selective`` only its element-wise work (SiLU, the norms' rsqrt), keeping matmul and attention
    outputs. Parameter names do not change (checkpoints stay valid)."""
    counts = {}
    for mode in AC_MODES:
        model = build_gpt(GPT_CONFIGS["gpt-tiny"], 0)
        names = [name for name, _ in model.named_parameters()]
        apply_activation_checkpointing(model, mode)
        assert [name for name, _ in model.named_parameters()] == names
        loss = model(torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))).mean()
        with OpCounter() as counter:
            loss.backward()
        counts[mode] = counter.ops
    layers, attention = 4, "_scaled_dot_product_flash_attention_for_cpu"
    assert counts["none"]["silu"] == counts["none"]["rsqrt"] == counts["none"][attention] == 0
    assert counts["selective"]["mm"] == counts["none"]["mm"] and counts["selective"][attention] == 0
    assert counts["selective"]["silu"] == layers and counts["selective"]["rsqrt"] == 2 * layers
    # Each block's 7 linears but the last again (recomputation stops once backward has what it needs).
    assert counts["full"]["mm"] == counts["none"]["mm"] + 6 * layers
    assert counts["full"][attention] == layers and counts["full"]["silu"] == layers


# --- Data and accounting -------------------------------------------------------------------------


def test_token_batches_depend_only_on_seed_and_step(tmp_path: Path) -> None:
    synthetic = SyntheticTokens(seed=5, vocab_size=256)
    batch = synthetic.batch(3, 8, 16)
    assert batch.shape == (8, 17) and batch.dtype == np.int64
    assert np.array_equal(batch, SyntheticTokens(5, 256).batch(3, 8, 16))
    assert not np.array_equal(batch, synthetic.batch(4, 8, 16))
    # Two replicas' slices are the one-replica batch, cut in two.
    halves = [replica_rows(batch, replica, 4) for replica in (0, 1)]
    assert np.array_equal(np.concatenate(halves), batch)
    (tmp_path / "a.txt").write_bytes(b"hello world, " * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"\x00\xff" * 20)
    corpus = TextCorpus.load(tmp_path, seed=1, seq_len=16)
    assert len(corpus.data) == 170
    rows = corpus.batch(0, 6, 16)
    assert rows.shape == (6, 17) and rows.max() < 256
    assert np.array_equal(rows, TextCorpus.load(tmp_path, 1, 16).batch(0, 6, 16))
    text = bytes(corpus.data)
    assert all(bytes(row.astype(np.uint8)) in text for row in rows)


def test_text_corpus_refusals(tmp_path: Path) -> None:
    from training.data.imagenet import DataDirError

    with pytest.raises(DataDirError, match="does not exist"):
        TextCorpus.load(tmp_path / "missing", 0, 8)
    (tmp_path / "short.txt").write_bytes(b"12345678")
    with pytest.raises(DataDirError, match="1 files with 8 bytes in all, fewer than one sequence"):
        TextCorpus.load(tmp_path, 0, 8)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("Tesla V100-SXM2-16GB", None),
        ("cpu", None),
    ],
)
def test_peak_flops_table(name: str, peak: float | None) -> None:
    assert memory.peak_flops(name) == peak


def test_mfu_and_local_parameters() -> None:
    assert memory.mfu(1000.0, 1e12, "NVIDIA H100 80GB HBM3", 2) == pytest.approx(1000 * 1e12 / (2 * 989e12))
    assert memory.mfu(1000.0, 1e12, "cpu", 1) is None
    assert memory.mfu(None, 1e12, "NVIDIA H200", 1) is None
    shared = torch.nn.Linear(4, 3)
    assert memory.local_parameters([shared, shared]) == (15, 60)  # counted once


GB = 10**9


@pytest.mark.parametrize(
    ("device_bytes", "layout", "expected"),
    [
        (80 * GB, Layout(), "none"),  # one H100: gpt-1.3b at seq 2048 x 4 needs no recomputation
        (40 * GB, Layout(), "selective"),
        (32 * GB, Layout(), "full"),
        (16 * GB, Layout(), "full"),  # fits nothing: the least memory, and a warning
        (32 * GB, Layout(dp_shard=8), "none"),  # sharded 8 ways, the state is small
        (None, Layout(), "none"),  # a CPU
    ],
)
def test_auto_activation_checkpointing_follows_the_memory_estimate(
    device_bytes: int | None, layout: Layout, expected: str
) -> None:
    cfg = GPT_CONFIGS["gpt-1.3b"]
    estimates = [memory.estimate_bytes(cfg, Layout(), 4, 2048, "bf16", mode) for mode in ("none", "selective", "full")]
    assert estimates == sorted(estimates, reverse=True)  # more recomputation, less memory
    # The H100 run of issue 19 peaked at 32.8 GiB (the job) and 37 GiB (a bare loop) without AC.
    assert 37 * 2**30 <= estimates[0] <= 45 * 2**30
    assert memory.choose_activation_checkpointing("auto", cfg, layout, 4, 2048, "bf16", device_bytes) == expected
    assert memory.choose_activation_checkpointing("selective", cfg, layout, 4, 2048, "bf16", 80 * GB) == "selective"
    assert memory.choose_activation_checkpointing("auto", None, layout, 4, None, "bf16", 80 * GB) == "none"  # ResNets


def test_every_flag_and_metric_is_documented() -> None:
    from training.config.args import build_parser
    from training.model_parallel import METRIC_KEYS, PROG

    doc = (REPO / "docs" / "parallelism.md").read_text()
    # the PyTorch jobs' one parser has one flag table, in training.md
    flags_section = (REPO / "docs" / "training.md").read_text().split("## Flags", 1)[1].split("\n## ", 1)[0]
    metrics_section = doc.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    actions = build_parser("pytorch", PROG)._actions
    flags = [o for action in actions for o in action.option_strings if o.startswith("--")]
    assert [flag for flag in flags if flag != "--help" and f"`{flag}" not in flags_section] == []
    assert [key for key in METRIC_KEYS if f"`{key}`" not in metrics_section] == []


def test_a_replicas_tokens_are_uploaded_once_as_contiguous_rows() -> None:
    """Inputs and targets are views of one contiguous upload: the pinned buffer is what the copy
    engine reads (a strided view would first be gathered into pageable memory)."""
    from training import model_parallel

    settings = model_parallel.parse_settings(["--model", "gpt-tiny", "--seq-len", "16", "--batch-size", "4"])
    batches = model_parallel.Batches(settings, replica=1, device=torch.device("cpu"))
    inputs, targets = batches(step=3, replicas=2)
    assert inputs.untyped_storage().data_ptr() == targets.untyped_storage().data_ptr()
    rows = torch.from_numpy(SyntheticTokens(settings.seed, settings.gpt.vocab_size).batch(3, 8, 16))[4:]
    assert torch.equal(inputs, rows[:, :-1]) and torch.equal(targets, rows[:, 1:])
    assert inputs.untyped_storage().nbytes() == rows.numel() * rows.element_size()  # the rows alone, once
