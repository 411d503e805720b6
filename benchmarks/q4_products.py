"""Exact 4-bit blocks in integers against int8 weights: the default model's 120 layer matrices.

The kernel's ``q4_linear`` (the Q4_1 GGUF's own codes and scales, exact integer sums per block)
with int16 activations (int4, session 41, ``q4``) and with 8-bit blocks of activations (w4a8,
session 42, ``q4a8``) against the int8 model's paired products (``FastLlamaKernel.linear``, as its
decoding steps run them), over every layer matrix of SmolLM2-135M, M input rows, the three
alternating round by round. Prints min / median ms per pass over all 120 matrices, and each
format's largest error against float32 products, relative to the largest output, over the first 8
matrices. Run it alone on the machine (``flock /tmp/verispec-cpu.lock``).

    python benchmarks/q4_products.py [--rows 1 2 5 9 128] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.models import fast_llama
from verispec.models.fast_llama import _q4_blocks
from verispec.models.loading import load_hf, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 128])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()

    module = fast_llama._load_kernel()
    if module is None or not module.vnni_tiles_ready():
        raise SystemExit("q4_linear needs the kernel built with AVX-512 VNNI")
    hf, _, _ = load_hf("default")
    int8 = load_model("default", dtype="int8")
    kernel = int8._kernel
    mats = []  # (rows, q4 packed, int8 paired codes, int8 scales, float32 matrix)
    for i, blk in enumerate(hf.model.layers):
        att, mlp = blk.self_attn, blk.mlp
        parts = {
            "wqkv": (att.q_proj, att.k_proj, att.v_proj),
            "wo": (att.o_proj,),
            "wgu": (mlp.gate_proj, mlp.up_proj),
            "wdown": (mlp.down_proj,),
        }
        for name, projs in parts.items():
            w = torch.cat([p.weight.detach().float() for p in projs])
            blocks = _q4_blocks(w)
            if blocks is None:
                raise SystemExit(f"layer {i} {name} is not made of exact Q4_1 blocks")
            lw = int8._w["layers"][i]
            mats.append((w.shape[0], module.q4_pack(*blocks), lw[name], lw[name + "_scale"], w))
    q4_mb = sum(m[1].numel() for m in mats) / 1e6
    int8_mb = sum(m[2].numel() + 4 * m[3].numel() for m in mats) / 1e6
    print(f"bytes read per pass: q4 {q4_mb:.1f} MB, int8 {int8_mb:.1f} MB")

    def q4(x: torch.Tensor, m: tuple) -> torch.Tensor:
        return module.q4_linear(x, m[1], m[0])

    def q4a8(x: torch.Tensor, m: tuple) -> torch.Tensor:
        return module.q4_linear(x, m[1], m[0], a8=True)

    def int8_rows(x: torch.Tensor, m: tuple) -> torch.Tensor:
        return kernel.linear(x, m[2], None, m[3], paired=True)

    gen = torch.Generator().manual_seed(0)
    for rows in args.rows:
        xs = [torch.randn(rows, m[4].shape[1], generator=gen) for m in mats]
        kinds = {"q4": q4, "q4a8": q4a8, "int8": int8_rows}
        errors = {}
        for name, f in kinds.items():
            worst = 0.0
            for x, m in zip(xs[:8], mats[:8]):
                ref = x @ m[4].T
                worst = max(worst, float((f(x, m) - ref).abs().max() / ref.abs().max()))
            errors[name] = worst
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for r in range(args.rounds):
            for name in list(kinds) if r % 2 == 0 else list(kinds)[::-1]:
                start = time.perf_counter()
                for x, m in zip(xs, mats):
                    kinds[name](x, m)
                times[name].append((time.perf_counter() - start) * 1e3)
        cells = "  ".join(f"{n} {min(v):.2f} / {statistics.median(v):.2f} ms" for n, v in times.items())
        worst = ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
        print(f"{rows} rows: {cells}; largest error: {worst}", flush=True)


if __name__ == "__main__":
    main()
