"""The few-row matmul (engine/gemv.py) and the two-stage argmax against torch on one GPU.

    python3 tools/device/gemv_bench.py [--json OUT]

Checks first (fresh random inputs, output poisoned with NaN before each run): the kernel at
every configuration timed below against a float64 reference (relative error, beside
torch.matmul's), and fused.greedy_tokens against torch.argmax (ties included). Then times, in
CUDA graphs of 16 calls over rotating copies of the weight (more bytes than the L2 holds, as a
model's distinct layers are), each decode matmul of SmolLM2-135M, the 1.2B and the 3B shapes at
M = 1, 2, 4 rows: F.linear (cuBLAS) against each kernel configuration and the one `config_for`
picks, with GB/s of the weight's read; and the argmax over each vocabulary. The copy ceiling
(a 1 GiB device-to-device copy, read + write) is measured in the same run.
"""

# ruff: noqa: B023  (every lambda below runs at once, inside its loop iteration)
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from omni_server.engine import SHAPES, fused, gemv
from omni_server.engine.gemv import Config

CONFIGS = [
    Config(2, 1024, 4, 4),
    Config(4, 512, 4, 4),
    Config(4, 1024, 4, 4),
    Config(8, 256, 4, 4),
    Config(8, 512, 4, 4),
    Config(8, 1024, 8, 3),
    Config(16, 256, 4, 4),
    Config(16, 512, 8, 3),
]


def fits(m: int, c: Config) -> bool:
    """At most 64 float32 partial sums a thread (no spills)."""
    block_m = 1 << (m - 1).bit_length()
    return block_m * c.block_n * c.block_k <= 64 * 32 * c.num_warps


def matmuls(name: str) -> list[tuple[str, int, int]]:
    s = SHAPES[name]
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    c, i = s.hidden_size, s.intermediate_size
    return [
        ("qkv", q + 2 * kv, c),
        ("wo", c, q),
        ("gate_up", 2 * i, c),
        ("down", c, i),
        ("head", s.vocab_size, c),
    ]


def time_us(fn, reps: int = 20) -> float:
    """Median us of one call of fn (which runs 16 calls) in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 16)
    return sorted(times)[len(times) // 2]


def check(dtype: torch.dtype) -> list[str]:
    bad = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 2, 3, 4):
        for n, k in ((960, 576), (2048, 8192), (1000, 512), (5120, 3072)):
            x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
            w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
            ref = x.double() @ w.double().T
            torch_err = ((F.linear(x, w).double() - ref).norm() / ref.norm()).item()
            for c in [*CONFIGS, gemv.config_for(m, n, k)]:
                if c is None or not fits(m, c) or k % c.block_k:
                    continue
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                out.copy_(gemv.matmul(x, w, c))
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if not err <= max(2 * torch_err, 1e-2):  # NaN fails too
                    bad.append(
                        f"{dtype} m={m} n={n} k={k} {c}: err {err:.2e} (torch {torch_err:.2e})"
                    )
    for rows, vocab in ((1, 128256), (4, 49152), (3, 5000)):
        logits = torch.randn(rows, vocab, device="cuda", generator=gen)
        logits[0, vocab // 3] = logits[0, vocab - 7] = logits.max() + 1  # a tie: the first wins
        out = torch.full((rows,), -5, dtype=torch.int64, device="cuda")
        fused.greedy_tokens(logits, out)
        if not torch.equal(out, logits.argmax(dim=-1)):
            bad.append(f"argmax rows={rows} vocab={vocab}: {out.tolist()}")
    return bad


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True  # torch's default
    bad = check(torch.bfloat16) + check(torch.float16)
    print("checks:", "all passed" if not bad else "\n  ".join(["FAILED", *bad]))
    big = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(big)
    copy_us = time_us(lambda: [dst.copy_(big) for _ in range(16)], reps=5)
    print(f"copy ceiling: {2 * big.numel() * 2 / copy_us / 1e3:.0f} GB/s (read + write)")
    rows = []
    for name in ("smollm2-135m", "llama-1b", "llama-3b"):
        for label, n, k in matmuls(name):
            copies = max(2, min(16, -(-(256 << 20) // (n * k * 2))))
            ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            for m in (1, 2, 4):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                order = [ws[i % copies] for i in range(16)]
                row = {"shape": name, "matmul": label, "n": n, "k": k, "m": m}
                row["cublas_us"] = time_us(lambda: [F.linear(x, w) for w in order])
                best = None
                for c in CONFIGS:
                    if not fits(m, c) or k % c.block_k:
                        continue
                    us = time_us(lambda c=c: [gemv.matmul(x, w, c) for w in order])
                    row[str(tuple(c))] = us
                    if best is None or us < best[1]:
                        best = (c, us)
                picked = gemv.config_for(m, n, k)
                row["picked"] = None if picked is None else tuple(picked)
                row["picked_us"] = (
                    None
                    if picked is None
                    else time_us(lambda: [gemv.matmul(x, w, picked) for w in order])
                )
                row["best"] = None if best is None else (tuple(best[0]), best[1])
                rows.append(row)
                gbs = lambda us: n * k * 2 / us / 1e3  # noqa: E731
                b = f"{best[1]:7.2f} us {gbs(best[1]):5.0f} GB/s {tuple(best[0])}" if best else "-"
                pk = row["picked_us"]
                print(
                    f"{name:13} {label:8} {n:6}x{k:<5} m={m}  cublas {row['cublas_us']:7.2f} us "
                    f"{gbs(row['cublas_us']):5.0f} GB/s | best {b} | picked "
                    f"{'-' if pk is None else f'{pk:7.2f}'}"
                )
            del ws
    for vocab in (49152, 128256):
        logits = torch.randn(1, vocab, device="cuda")
        outs = torch.empty(1, dtype=torch.int64, device="cuda")
        t_torch = time_us(lambda: [torch.argmax(logits, dim=-1, out=outs) for _ in range(16)])
        t_ours = time_us(lambda: [fused.greedy_tokens(logits, outs) for _ in range(16)])
        print(f"argmax 1 x {vocab}: torch {t_torch:.2f} us, two-stage {t_ours:.2f} us")
        rows.append({"argmax": vocab, "torch_us": t_torch, "two_stage_us": t_ours})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
