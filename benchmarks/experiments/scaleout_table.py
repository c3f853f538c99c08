"""Paper arithmetic for scale-out (docs/scale_out.md): per chip and per verify step of a
tensor-parallel target, the bytes read from HBM, the weight-streaming floor those bytes set
at the chip's HBM bandwidth, and the bytes and count of collectives, so a user can predict
tokens/s as ``tau / (floor + communication + overheads)``.

    python -m benchmarks.experiments.scaleout_table            # the markdown table in the README

Assumptions (change them below): bfloat16 weights, activations and KV cache; batch B = 1;
gamma = 4 (a verify window of T = 5 tokens); 2048 cache slots read per step (attention reads
the whole static cache); the whole slice on the ``model`` axis (mesh 1xN); chip figures
from Google's Cloud TPU pages (HBM bandwidth per chip, HBM capacity per chip). A "v5p-8"
slice is 4 chips (v5p slice names count TensorCores, 2 per chip); v5e-8 and v6e-8 are 8.
Nothing here is measured: no TPU was available.
"""

from __future__ import annotations

import dataclasses
import json
import sys

BYTES = 2  # bfloat16
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    chips: int  # chips in the slice named by ``name``
    hbm_gbs: float  # HBM bandwidth per chip, GB/s (1e9 bytes/s)
    hbm_gib: float  # HBM capacity per chip, GiB
    ici_gbs: float  # inter-chip interconnect bandwidth per chip, GB/s (Gbps / 8)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int


CHIPS = [
    Chip("v5e-8", 8, 819, 16, 1600 / 8),
    Chip("v5p-8", 4, 2765, 95, 4800 / 8),
    Chip("v6e-8", 8, 1640, 32, 3584 / 8),
]
MODELS = [
    Shape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    Shape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
]
B, GAMMA, CONTEXT = 1, 4, 2048


def step_cost(m: Shape, chip: Chip, batch: int = B, gamma: int = GAMMA, context: int = CONTEXT) -> dict:
    """Per-chip bytes and floor of one verify step of ``m`` split over all of ``chip``'s chips."""
    n, t = chip.chips, gamma + 1
    kv_local = max(m.kv_heads, n) // n  # KV heads per chip (repeated when fewer than n)
    attn = m.dim * m.heads * m.head_dim * 2 + m.dim * m.kv_heads * m.head_dim * 2  # wq, wo, wk, wv
    kv_weights_per_chip = m.dim * kv_local * m.head_dim * 2
    per_layer_chip = (m.dim * m.heads * m.head_dim * 2 + 3 * m.dim * m.ffn) / n + kv_weights_per_chip
    params = m.layers * (attn + 3 * m.dim * m.ffn) + 2 * m.vocab * m.dim  # + embed and head
    weights_chip = (m.layers * per_layer_chip + 2 * m.vocab * m.dim / n) * BYTES  # resident
    # read per step: every layer and the output head; the embedding only at T rows (ignored)
    read_weights = (m.layers * per_layer_chip + m.vocab * m.dim / n) * BYTES
    read_kv = m.layers * 2 * batch * context * kv_local * m.head_dim * BYTES
    kv_cache_chip = read_kv  # the cache a chip holds is what it reads (all slots, every step)
    floor_ms = (read_weights + read_kv) / (chip.hbm_gbs * 1e9) * 1e3
    act = batch * t * m.dim * BYTES  # one [B, T, D] activation
    all_reduces = 2 * m.layers + 1  # after wo and w_down in every layer, and the embedding
    ring = 2 * (n - 1) / n  # bytes a chip sends per byte all-reduced (ring; halves for all-gather)
    comm = all_reduces * act * ring + batch * t * m.vocab * 4 * (n - 1) / n  # + float32 logits all-gather
    fits = weights_chip + kv_cache_chip < chip.hbm_gib * GIB
    return {
        "model": m.name, "slice": chip.name, "chips": n, "params_b": params / 1e9,
        "weights_per_chip_gb": weights_chip / 1e9, "hbm_gib": chip.hbm_gib, "fits": fits,
        "read_per_step_gb": (read_weights + read_kv) / 1e9, "kv_read_mb": read_kv / 1e6,
        "floor_ms": floor_ms, "comm_per_step_mb": comm / 1e6, "collectives_per_step": all_reduces + 1,
        "comm_bandwidth_us": comm / (chip.ici_gbs * 1e9) * 1e6,
        "tokens_per_s_at_floor_tau1": 1e3 / floor_ms, "tokens_per_s_at_floor_tau3": 3e3 / floor_ms,
    }


def table() -> str:
    rows = [step_cost(m, c) for m in MODELS for c in CHIPS]
    head = ("| target | slice (chips) | weights/chip GB (HBM GiB) | read/step/chip GB (KV MB) | HBM floor ms/step "
            "| comm/step/chip MB (collectives, time at ICI bw) | tok/s at floor, tau 1 / tau 3 |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        fit = "" if r["fits"] else " **does not fit**"
        lines.append(
            f"| {r['model']} | {r['slice']} ({r['chips']}) | {r['weights_per_chip_gb']:.2f} ({r['hbm_gib']}){fit} "
            f"| {r['read_per_step_gb']:.2f} ({r['kv_read_mb']:.0f}) | {r['floor_ms']:.2f} "
            f"| {r['comm_per_step_mb']:.1f} ({r['collectives_per_step']}, {r['comm_bandwidth_us']:.0f} us) "
            f"| {r['tokens_per_s_at_floor_tau1']:.0f} / {r['tokens_per_s_at_floor_tau3']:.0f} |")
    return head + "\n".join(lines)


if __name__ == "__main__":
    if "--json" in sys.argv:
        print(json.dumps([step_cost(m, c) for m in MODELS for c in CHIPS], indent=1))
    else:
        print(table())
