"""Load benchmark for ``verispec serve``, and the batch-size crossover of speculation.

Two modes, both on Spec-Bench prompts (the same file ``verispec bench`` reads), greedy, ``ignore_eos``
so every request produces exactly ``--max-tokens`` tokens:

``crossover``
    In process, no HTTP: B sequences stepped together by the engine (as the server batches them), at
    draft lengths k = 0 (plain decoding), 1, 2, 4 with prompt lookup or a draft model. Prints decode
    tokens/s and the speedup over k = 0 per batch size: where the speedup falls below 1 is where the
    server's batch policy should stop speculating.

``compare``
    The goal "at 1 client, the server's speedup is within 10% of the bench's": for each prompt, in an
    order rotated per prompt, in process (``speculative_generate``, the engine the bench runs) plain
    and speculative, and through one server at 1 client with speculation off and on; whole request
    (prompt included), ``ignore_eos``. Prints both speedups and their ratio.

``load``
    Starts a server on 127.0.0.1 (a free port), then for each client count C runs C concurrent
    streaming clients, each sending ``--requests`` requests one after another, once with speculation
    on (the server's batch-aware policy) and once with it off per request
    (``"speculative": {"enabled": false}``). Reports total throughput (completion tokens / wall time),
    mean time to first token, mean inter-token latency and request latency.

Every mode drafts by prompt lookup alone unless given ``--speculative-model`` (a draft) or
``--default-drafter`` (what ``verispec serve`` drafts with when no drafter is named).

Run it alone on the machine: timings taken while other jobs use the cores are meaningless.

    flock /tmp/verispec-cpu.lock python benchmarks/load_test.py crossover --batch 1 4 8 16
    flock /tmp/verispec-cpu.lock python benchmarks/load_test.py load --clients 1 4 16
    flock /tmp/verispec-cpu.lock python benchmarks/load_test.py compare --per-category 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from verispec.bench.prompts import load_prompts


def bench_prompts(categories: list[str], count: int) -> list[str]:
    """``count`` prompts cycling over the first questions of ``categories`` (file order)."""
    prompts = load_prompts()
    chosen = [[p.text for p in prompts if p.category == c] for c in categories]
    chosen = [c for c in chosen if c]
    if not chosen:
        raise SystemExit(f"no prompts in categories {categories}")
    return [chosen[i % len(chosen)][i // len(chosen) % len(chosen[i % len(chosen)])] for i in range(count)]


def lookup_only(args: argparse.Namespace) -> bool:
    """Whether the runs draft by prompt lookup alone: no ``--speculative-model`` and no
    ``--default-drafter`` (the server's and ``generate``'s own choice when no drafter is named)."""
    return args.speculative_model is None and not args.default_drafter


# ----- crossover: the engine alone -----


def crossover(args: argparse.Namespace) -> None:
    import torch

    from verispec.commands.drafters import build_proposer
    from verispec.config import GenerationConfig, SamplingConfig
    from verispec.engine import Engine
    from verispec.models.loading import load_model
    from verispec.tokenizers import encode_prompt

    torch.set_grad_enabled(False)
    biggest = max(args.batch)
    target = load_model(args.model, dtype=args.dtype, max_batch_size=biggest, max_length=args.max_model_len)
    proposer = build_proposer(target, args.speculative_model, lookup_only(args), max_batch_size=biggest)
    tok = target.tokenizer
    texts = bench_prompts(args.categories, biggest)
    prompts = [encode_prompt(tok, t, chat=target.instruct)[-args.max_prompt_tokens :] for t in texts]
    rows = []
    greedy = SamplingConfig(temperature=0)
    for k in args.k:  # warm-up, uncounted: the first calls of a process run slower
        engine = Engine(target, proposer if k else None, eos_token_ids=target.eos_token_ids)
        warm = GenerationConfig(max_new_tokens=8, num_speculative_tokens=k, sampling=greedy, ignore_eos=True)
        for _ in engine.run([engine.new_sequence(prompts[0], warm)]):
            pass
    for batch in args.batch:
        base = None
        for k in args.k:
            engine = Engine(target, proposer if k else None, eos_token_ids=target.eos_token_ids)
            config = GenerationConfig(
                max_new_tokens=args.max_tokens,
                num_speculative_tokens=k,
                sampling=greedy,
                ignore_eos=True,
            )
            seqs = [engine.new_sequence(p, config) for p in prompts[:batch]]
            steps = 0
            start = None
            for _ in engine.run(seqs):
                if start is None:  # timing starts after the first step, once every prompt is in
                    start, first_tokens = time.perf_counter(), sum(len(s.output_ids) for s in seqs)
                steps += 1
            seconds = time.perf_counter() - start
            tokens = sum(len(s.output_ids) for s in seqs) - first_tokens
            drafted = sum(s.stats.draft_tokens for s in seqs)
            accepted = sum(s.stats.accepted_tokens for s in seqs)
            tps = tokens / seconds
            base = tps if k == 0 else base
            row = {
                "batch": batch,
                "k": k,
                "tokens_per_second": round(tps, 1),
                "speedup": round(tps / base, 2) if base else None,
                "acceptance_rate": round(accepted / drafted, 2) if drafted else None,
                "ms_per_step": round(1000 * seconds / max(1, steps - 1), 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| batch | k | tokens/s | speedup vs k=0 | acceptance | ms/step |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['k']} | {r['tokens_per_second']} | {r['speedup']} | "
            f"{r['acceptance_rate']} | {r['ms_per_step']} |"
        )


# ----- load: HTTP clients against a server -----


@dataclass
class Sample:
    """One request as a client saw it."""

    tokens: int
    ttft: float
    latency: float
    gaps: list[float]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "verispec.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max(args.clients)),
        "--max-model-len",
        str(args.max_model_len),
        "-k",
        str(args.num_speculative_tokens),
        "--dtype",
        args.dtype,
    ]
    if args.speculative_model:
        cmd += ["--speculative-model", args.speculative_model]
    if lookup_only(args):
        cmd += ["--prompt-lookup"]
    if args.batch_policy:
        cmd += ["--batch-policy", args.batch_policy]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server exited during startup")
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not start")


async def one_client(client, prompts: list[str], args: argparse.Namespace, speculate: bool) -> list[Sample]:
    out = []
    for prompt in prompts:
        start = time.perf_counter()
        stamps = []
        tokens = 0
        stream = await client.chat.completions.create(
            model="bench",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "speculative": {"enabled": speculate}},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        out.append(
            Sample(tokens=tokens, ttft=(stamps[0] if stamps else end) - start, latency=end - start, gaps=gaps)
        )
    return out


async def run_load(
    url: str, clients: int, prompts: list[str], args: argparse.Namespace, speculate: bool
) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    per_client = [
        prompts[(c * args.requests + r) % len(prompts)] for c in range(clients) for r in range(args.requests)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            one_client(client, per_client[c * args.requests : (c + 1) * args.requests], args, speculate)
            for c in range(clients)
        )
    )
    wall = time.perf_counter() - start
    await client.close()
    samples = [s for r in results for s in r]
    gaps = [g for s in samples for g in s.gaps]
    return {
        "clients": clients,
        "speculation": speculate,
        "requests": len(samples),
        "throughput_tokens_per_s": round(sum(s.tokens for s in samples) / wall, 1),
        "mean_ttft_s": round(statistics.mean(s.ttft for s in samples), 3),
        "mean_itl_ms": round(1000 * statistics.mean(gaps), 1) if gaps else None,
        "mean_latency_s": round(statistics.mean(s.latency for s in samples), 2),
    }


def load(args: argparse.Namespace) -> None:
    import httpx

    prompts = bench_prompts(args.categories, max(args.clients) * args.requests)
    proc, url = start_server(args)
    rows = []
    try:
        asyncio.run(run_load(url, 1, prompts[:1], argparse.Namespace(**{**vars(args), "requests": 1}), True))
        for clients in args.clients:
            for speculate in (True, False):
                row = asyncio.run(run_load(url, clients, prompts, args, speculate))
                rows.append(row)
                print(json.dumps(row), flush=True)
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print("\n| clients | speculation | tokens/s | speedup | mean TTFT s | mean ITL ms | mean latency s |")
    print("|---|---|---|---|---|---|---|")
    for on, off in zip(rows[::2], rows[1::2]):
        for r in (on, off):
            speedup = round(r["throughput_tokens_per_s"] / off["throughput_tokens_per_s"], 2)
            mode = "on" if r["speculation"] else "off"
            print(
                f"| {r['clients']} | {mode} | {r['throughput_tokens_per_s']} | {speedup} | "
                f" {r['mean_ttft_s']} | {r['mean_itl_ms']} | {r['mean_latency_s']} |"
            )
    accepted = [line for line in metrics.splitlines() if line.startswith("verispec:spec_decode")]
    print("\n" + "\n".join(accepted))


def compare(args: argparse.Namespace) -> None:
    import httpx
    import torch

    from verispec.api import speculative_generate
    from verispec.commands.drafters import build_proposer
    from verispec.models.loading import load_model
    from verispec.tokenizers import encode_prompt

    torch.set_grad_enabled(False)
    texts = [
        p.text
        for c in args.categories
        for p in [q for q in load_prompts() if q.category == c][: args.per_category]
    ]
    if not texts:
        raise SystemExit(f"no prompts in categories {args.categories}")
    target = load_model(args.model, max_length=args.max_model_len, dtype=args.dtype)
    proposer = build_proposer(target, args.speculative_model, lookup_only(args), dtype=args.dtype)
    ids = [encode_prompt(target.tokenizer, t, chat=target.instruct) for t in texts]
    proc, url = start_server(argparse.Namespace(**{**vars(args), "clients": [1]}))
    client = httpx.Client(timeout=600)

    def local(i: int, spec: bool) -> tuple[int, float]:
        start = time.perf_counter()
        out = speculative_generate(
            target,
            proposer if spec else None,
            ids[i],
            max_new_tokens=args.max_tokens,
            num_speculative_tokens=args.num_speculative_tokens if spec else 0,
            temperature=0,
            ignore_eos=True,
        )
        return len(out.token_ids), time.perf_counter() - start

    def served(i: int, spec: bool) -> tuple[int, float]:
        start = time.perf_counter()
        r = client.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "bench",
                "messages": [{"role": "user", "content": texts[i]}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "speculative": {"enabled": spec},
            },
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], time.perf_counter() - start

    modes = {
        "bench plain": (local, False),
        "bench speculative": (local, True),
        "server off": (served, False),
        "server on": (served, True),
    }
    totals = {m: [0, 0.0] for m in modes}
    try:
        for fn, spec in modes.values():  # warm-up, uncounted
            fn(0, spec)
        for i in range(len(texts)):
            names = list(modes)
            for m in names[i % 4 :] + names[: i % 4]:
                fn, spec = modes[m]
                tokens, seconds = fn(i, spec)
                totals[m][0] += tokens
                totals[m][1] += seconds
            so_far = {m: round(t / s, 2) for m, (t, s) in totals.items()}
            print(json.dumps({"prompt": i, **so_far}), flush=True)
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
    tps = {m: t / s for m, (t, s) in totals.items()}
    bench_speedup = tps["bench speculative"] / tps["bench plain"]
    server_speedup = tps["server on"] / tps["server off"]
    print("\n| mode | tokens/s |\n|---|---|")
    for m, v in tps.items():
        print(f"| {m} | {v:.1f} |")
    print(
        f"\nbench speedup {bench_speedup:.2f}x, server speedup at 1 client {server_speedup:.2f}x, "
        f"ratio {server_speedup / bench_speedup:.2f} ({len(texts)} prompts, {args.max_tokens} tokens each)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("crossover", "load", "compare"):
        s = sub.add_parser(name)
        s.add_argument("--model", default="default")
        s.add_argument("--speculative-model", default=None, help="draft model (default: prompt lookup)")
        s.add_argument(
            "--default-drafter",
            action="store_true",
            help="draft as the server does when no drafter is named (lookup first with the shipped "
            "draft behind it; prompt lookup alone for int8) instead of prompt lookup alone",
        )
        s.add_argument("--max-tokens", type=int, default=64)
        s.add_argument("--max-model-len", type=int, default=2048)
        s.add_argument("--dtype", default="float32", help="weight format (server and in process)")
        s.add_argument("--categories", nargs="+", default=["summarization", "rag", "mt_bench", "qa"])
    c = sub.choices["crossover"]
    c.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    c.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 4])
    c.add_argument("--max-prompt-tokens", type=int, default=768, help="keep the last N prompt tokens")
    lo = sub.choices["load"]
    lo.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    lo.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    for name in ("load", "compare"):
        s = sub.choices[name]
        s.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
        s.add_argument("--batch-policy", default=None, help="passed to the server (default: its policy)")
    cmp = sub.choices["compare"]
    cmp.add_argument("--per-category", type=int, default=2)
    args = p.parse_args()
    {"crossover": crossover, "load": load, "compare": compare}[args.mode](args)


if __name__ == "__main__":
    main()
