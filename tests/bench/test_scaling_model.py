"""The analytical scaling model: closed forms, limits, and the anchors it is shown beside."""

from __future__ import annotations

import math

import pytest

from bench.harness.scaling_model import (
    ANCHORS,
    DEFAULT_FUSION_BYTES,
    GB,
    ND_H100_V5,
    RESNET50_PARAMS,
    Workload,
    cluster_efficiency,
    efficiency,
    h100_projection,
    implied_bus_gbps,
    ring_allreduce_s,
)


def test_ring_allreduce_time_is_two_n_minus_one_over_n_bytes_over_bandwidth() -> None:
    assert ring_allreduce_s(100e6, 2, 1e9) == pytest.approx(0.1)
    assert ring_allreduce_s(100e6, 8, 1e9) == pytest.approx(2 * 7 / 8 * 0.1)
    assert ring_allreduce_s(100e6, 1, 1e9) == 0.0
    # The bandwidth term approaches 2 x bytes / busBW and never exceeds it.
    assert ring_allreduce_s(1.0, 10**6, 1.0) < 2.0


@pytest.mark.parametrize(("workers", "bw"), [(0, 1e9), (2, 0.0)])
def test_ring_rejects_impossible_inputs(workers: int, bw: float) -> None:
    with pytest.raises(ValueError):
        ring_allreduce_s(1.0, workers, bw)


def test_efficiency_without_overlap_or_latency_matches_hand_computation() -> None:
    work = Workload(step_s=0.3, grad_bytes=100e6)
    # t_ring = 0.1 s; E = 0.3 / (0.3 + 0.1)
    assert efficiency(work, 2, 1e9, overlap=0.0, alpha_s=0.0) == pytest.approx(0.75)


def test_overlap_hides_communication_up_to_its_fraction_of_the_step() -> None:
    work = Workload(step_s=0.3, grad_bytes=100e6)
    assert efficiency(work, 2, 1e9, overlap=0.5, alpha_s=0.0) == pytest.approx(1.0)  # 0.1 s < 0.15 s hidden
    assert efficiency(work, 2, 0.5e9, overlap=0.5, alpha_s=0.0) == pytest.approx(0.3 / 0.35)  # 0.2 - 0.15 left


def test_latency_term_counts_fused_buckets_and_log_hops() -> None:
    work = Workload(step_s=1.0, grad_bytes=DEFAULT_FUSION_BYTES * 1.5)  # two buckets
    exposed = 1.0 / efficiency(work, 16, math.inf, overlap=0.0, alpha_s=1e-3) - 1.0
    assert exposed == pytest.approx(2 * 2 * 4 * 1e-3)


def test_one_worker_is_perfectly_efficient_and_efficiency_falls_with_scale() -> None:
    work = Workload.from_throughput(357, 64, RESNET50_PARAMS * 4)
    assert efficiency(work, 1, 1.0) == 1.0
    values = [efficiency(work, n, 2 * GB, overlap=0.0) for n in (2, 8, 64, 512)]
    assert values == sorted(values, reverse=True)
    assert all(0 < v < 1 for v in values)


def test_overlap_must_be_a_fraction() -> None:
    with pytest.raises(ValueError):
        efficiency(Workload(1.0, 1.0), 2, 1.0, overlap=1.5)


def test_implied_bandwidth_inverts_the_model() -> None:
    work = Workload(step_s=0.2, grad_bytes=50e6)
    for measured in (0.57, 0.84, 0.99):
        bw = implied_bus_gbps(work, 32, measured)
        assert efficiency(work, 32, bw * GB, overlap=0.0, alpha_s=0.0) == pytest.approx(measured)
    assert implied_bus_gbps(work, 32, 1.0) == math.inf


def test_cluster_uses_nvlink_inside_a_node_and_infiniband_across() -> None:
    work = Workload(step_s=0.01, grad_bytes=1e9)
    one = cluster_efficiency(work, ND_H100_V5, 1, overlap=0.0, alpha_s=0.0)
    assert one == pytest.approx(0.01 / (0.01 + 2 * 7 / 8 * 1e9 / (ND_H100_V5.intra_bus_gbps * GB)))
    two = cluster_efficiency(work, ND_H100_V5, 2, overlap=0.0, alpha_s=0.0)
    assert two == pytest.approx(0.01 / (0.01 + 2 * 15 / 16 * 1e9 / (ND_H100_V5.inter_bus_gbps * GB)))


def test_anchor_efficiencies_are_the_published_ones() -> None:
    published = {a.workers: round(a.measured_efficiency, 2) for a in ANCHORS}
    assert published == {32: 0.57, 8: 0.84, 512: 0.90}


def test_h100_projection_is_high_and_fp16_gradients_never_hurt() -> None:
    fp32 = dict(h100_projection())
    fp16 = dict(h100_projection(fp16_grads=True))
    assert all(0.9 < e <= 1.0 for e in fp32.values())
    assert all(fp16[n] >= fp32[n] for n in fp32)
