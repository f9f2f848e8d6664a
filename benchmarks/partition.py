"""How long placement planning takes for a Qwen3-30B-A3B-sized model (48 layers x 128 experts).

    python benchmarks/partition.py

Builds the memory model of such a model (Q4_K_M-like sizes: ~2.9 MB per expert, 1.2 GB of
non-expert weights) and a Zipf-like popularity profile whose skew differs by layer (fixed seed), then times plan_placement
for each policy and budget (best of 5). Target: well under a second.
"""

from __future__ import annotations

import time

import numpy as np

from moepass.pipeline.placement import Budget, ExpertGroup, MemoryModel, plan_placement
from moepass.pipeline.popularity import Popularity

LAYERS, EXPERTS, TOP_K = 48, 128, 8
BYTES_PER_EXPERT = 2_949_120  # 3 x 768 x 2048 weights at 4.5 bits + scales, about Q4_K_M's
GiB = 1024 ** 3


def main() -> None:
    groups = [ExpertGroup(f"blk.{i}.moe", EXPERTS, TOP_K, BYTES_PER_EXPERT, 768) for i in range(LAYERS)]
    memory = MemoryModel(1_200_000_000, groups, kv_bytes_per_token=2 * LAYERS * 4 * 128 * 2,
                         dims={"hidden": 2048, "vocab": 151_936, "heads": 32, "kv_heads": 4, "head_dim": 128,
                               "activation_bytes": 2})
    rng = np.random.default_rng(0)
    model = {"fingerprint": "benchmark", "moe_nodes": [{"node": g.node, "experts": EXPERTS, "top_k": TOP_K}
                                                        for g in groups]}
    popularity = Popularity.empty(model)
    for g in groups:
        weights = 1.0 / (1 + rng.permutation(EXPERTS)) ** rng.uniform(0.3, 1.5)  # skew differs by layer
        popularity.weight[g.node] = weights / weights.sum() * 100_000
        popularity.selected[g.node] = np.round(weights / weights.sum() * 800_000).astype(np.int64)
    print(f"{LAYERS} layers x {EXPERTS} experts, {memory.expert_bytes / GiB:.1f} GiB of experts")
    print("| policy | VRAM | resident experts | GPU hit rate (mass) | plan time (best of 5) |")
    print("|---|---|---|---|---|")
    for policy in ("global", "balanced", "uniform"):
        for vram in (8, 12, 16):
            times = []
            for _ in range(5):
                start = time.perf_counter()
                plan = plan_placement(memory, Budget(vram * GiB), None if policy == "uniform" else popularity,
                                      policy)
                times.append(time.perf_counter() - start)
            resident = sum(len(r) for r in plan.resident.values())
            print(f"| {policy} | {vram} GiB | {resident} of {LAYERS * EXPERTS} | "
                  f"{plan.prediction['gpu_hit_rate_by_mass']:.1%} | {min(times) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
