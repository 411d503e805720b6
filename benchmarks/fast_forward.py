"""Milliseconds per forward of T new tokens: HF eager vs FastLlama (float32, bfloat16, int8).

Each forward appends T tokens after a fixed context and is then rolled back (``truncate`` for
FastLlama, ``DynamicCache.crop`` for HF), so every run sees the same cache length. Prints the
median of ``--runs`` runs. Run it alone on the machine (``flock /tmp/verispec-cpu.lock``):
timings taken while other jobs use the cores are meaningless.

    python benchmarks/fast_forward.py [--model DIR] [--runs 15] [--context 64 ...] [--tokens 1 2 5 9]
        [--dtypes float32 bfloat16 int8] [--threads N] [--no-hf] [--no-torch]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from verispec.models.fast_llama import DTYPES, FastLlama


def load_default_model(path: str | None) -> torch.nn.Module:
    """The given directory, else SmolLM2-135M from verispec's converted copy (converting its GGUF
    the first time, about 30 s)."""
    from verispec.models.loading import model_folder

    return AutoModelForCausalLM.from_pretrained(
        path if path is not None else model_folder("default"), attn_implementation="eager"
    )


def median_ms(step: Callable[[], None], runs: int) -> tuple[float, float]:
    """Median and minimum wall time of ``step`` in ms, after two warm-up calls.

    The minimum is printed too because on a shared machine a run that loses a core to another job
    is slower by a lot; the minimum is the best estimate of the uncontended cost.
    """
    step()
    step()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def bench_hf(
    model: torch.nn.Module, context: torch.Tensor, tokens: list[int], runs: int
) -> list[tuple[float, float]]:
    """HF eager with a DynamicCache holding ``context`` ``[1, C]``; full logits for the T tokens."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context, past_key_values=cache, use_cache=True)
    results = []
    for t in tokens:
        ids = torch.randint(0, model.config.vocab_size, (1, t))

        def step(ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                model(ids, past_key_values=cache, use_cache=True)
            cache.crop(-ids.shape[1])  # transformers 5: negative = drop that many

        results.append(median_ms(step, runs))
    return results


def bench_fast(
    fast: FastLlama, context: torch.Tensor, tokens: list[int], runs: int
) -> list[tuple[float, float]]:
    """FastLlama after a prefill of ``context`` ``[1, C]``; full logits for the T tokens."""
    fast.reset(1)
    fast.forward(context, logits="none")
    keep = fast.lengths
    results = []
    for t in tokens:
        ids = torch.randint(0, fast.vocab_size, (1, t))

        def step(ids: torch.Tensor = ids) -> None:
            fast.forward(ids, logits="all")
            fast.truncate(keep)

        results.append(median_ms(step, runs))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument(
        "--context", type=int, nargs="+", default=[64], help="tokens already in the cache (one table each)"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5, 9])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES, help="weight formats")
    parser.add_argument("--threads", type=int, default=None, help="torch/kernel threads (default: torch's)")
    parser.add_argument("--no-hf", action="store_true", help="skip the (slow) HF eager baseline")
    parser.add_argument("--no-torch", action="store_true", help="skip FastLlama's torch-path rows")
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_default_model(args.model).float().eval()
    contexts = {n: torch.randint(0, model.config.vocab_size, (1, n)) for n in args.context}
    # rows[n]: each variant's timings at n cached tokens; each variant is built once for all n.
    rows: dict[int, list[tuple[str, list[tuple[float, float]]]]] = {n: [] for n in contexts}
    if not args.no_hf:
        for n, context in contexts.items():
            rows[n].append(("hf-eager float32", bench_hf(model, context, args.tokens, args.runs)))
    for dtype in args.dtypes:
        for use_kernel in (True, False)[: 1 if args.no_torch else 2]:
            fast = FastLlama.from_hf(model, dtype=dtype, max_length=4096, use_kernel=use_kernel)
            if use_kernel and not fast.uses_kernel:
                continue
            name = f"fast {dtype} {'kernel' if use_kernel else 'torch'}"
            print(f"{name}: {fast.weight_bytes() / 1e6:.0f} MB of weights per forward", flush=True)
            for n, context in contexts.items():
                rows[n].append((name, bench_fast(fast, context, args.tokens, args.runs)))
            del fast
    for n, table in rows.items():
        print(f"threads={torch.get_num_threads()} context={n} runs={args.runs} (median ms)")
        print_rows(table, args.tokens)


def print_rows(rows: list[tuple[str, list[tuple[float, float]]]], tokens: list[int]) -> None:
    """One line per variant: median (min) ms per T, and each T's median over T=1's."""
    header = "".join(f"{'T=' + str(t):>14}" for t in tokens)
    print(f"{'variant':<24}{header}   (median ms, min in brackets; then T over T=1)")
    for name, ms in rows:
        cells = "".join(f"{med:>8.1f} ({low:>4.1f})" for med, low in ms)
        ratios = ""
        if 1 in tokens:
            one = ms[tokens.index(1)][0]
            ratios = " ".join(f"{t}:{m / one:.2f}" for t, (m, _) in zip(tokens, ms) if t != 1)
        print(f"{name:<24}{cells}   {ratios}")


if __name__ == "__main__":
    main()
