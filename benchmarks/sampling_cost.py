"""What the shared sampling transform costs per call: ``logits_to_probs`` on ``[1, T, V]`` logits.

Random logits (standard normal times ``--scale``) over the default model's vocabulary, temperature
0.7, with neither filter, top-k 50, top-p 0.9, and both; T = 1 (a plain sampled step) and T = 5 (a
verification of 4 drafts). Prints the mean ms of ``--calls`` calls after 5 uncounted ones, for the
transform in torch operations and, where the C++ kernel builds, for its one-pass ``sampling_probs``
(which ``logits_to_probs`` takes for float32 logits once the kernel is loaded).

    flock /tmp/verispec-cpu.lock python benchmarks/sampling_cost.py [--vocab 49152] [--calls 50]
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec import sampling
from verispec.models import fast_llama
from verispec.sampling import SamplingTensors, logits_to_probs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--scale", type=float, default=3.0)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    settings = {"temperature": (0, 1.0), "top-k 50": (50, 1.0), "top-p 0.9": (0, 0.9), "both": (50, 0.9)}
    # The torch transform itself, and logits_to_probs, which takes the kernel's once it is loaded.
    paths = {"torch": sampling._probs_torch}
    if fast_llama._load_kernel() is not None:
        paths["kernel"] = logits_to_probs
    gen = torch.Generator().manual_seed(0)
    for t in (1, 5):
        logits = torch.randn(1, t, args.vocab, generator=gen) * args.scale  # [1, T, V]
        for name, (top_k, top_p) in settings.items():
            params = SamplingTensors.of(
                torch.tensor([0.7], dtype=torch.float64),
                torch.tensor([top_k]),
                torch.tensor([top_p], dtype=torch.float64),
            )
            cells = []
            for path, transform in paths.items():
                for _ in range(5):
                    transform(logits, params)
                start = time.perf_counter()
                for _ in range(args.calls):
                    transform(logits, params)
                cells.append(f"{path} {(time.perf_counter() - start) / args.calls * 1e3:.3f}")
            print(f"T={t} {name}: " + ", ".join(cells) + " ms", flush=True)


if __name__ == "__main__":
    main()
