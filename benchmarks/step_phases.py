"""Where a greedy step's time goes: microseconds per step in each part of the C++ kernel's forward.

Builds a copy of ``verispec/csrc/fast_llama.cpp`` (or ``--source``) with a clock read after each
part of a layer (the norms, the qkv product, writing the cache, attention, the output product, the
gate/up product, SwiGLU, the down product) and around the head, loads the model on it, and times
greedy steps of each width after ``--context`` cached tokens (the cache truncated back after each),
``--steps`` of each width in a row. It prints, per width, the step's min / median ms and the mean
microseconds per step in each part. The clock reads cost well under a microsecond each. Where
w4a8 folds the jobs between its products into the jobs before them (the kernel's ``set_fuse``), its
cache writes count in the qkv product, SwiGLU in the gate/up product, and the 8-bit activations of
each product in the norm, attention or gate/up product that writes its input. In calls of up to 8
tokens the products' threads form their own input rows (the kernel's ``set_own_rows``): w4a8's
norms then count in its qkv and gate/up products, int4's SwiGLU and cache writes as w4a8's, and
int4's and int8's norms in the products after them. Wide int8, int4 and w4a8 calls (prompt
pieces) run their layers by rows (the kernel's ``set_rows``, ``layers_by_rows``), which this does
not clock part by part (it says so where the kernel counted such calls): ``--columns`` times them
split by columns instead.

    flock /tmp/verispec-cpu.lock python benchmarks/step_phases.py [--dtype int8] [--widths 1 2 3 5 9]
        [--amx-rows 10 1] [--steps 100] [--context 200] [--source FILE] [--placement --blocks 40]
        [--columns]

``--placement``: ``--blocks`` rounds of ``--steps`` steps of each width, each round labelled by where
the two threads' cores sat (``verispec bench``'s core round trip, read before it), and per placement
the median over its rounds of each figure (a VM's vCPUs move between cores that share an L3 and
cores on different CCDs within minutes; benchmarks/README.md).

``--amx-rows`` (int8 on a CPU with AMX tiles): from how many tokens a call reads the tiles, one
line per value and width. A float32 model's greedy head is its screen (``final`` and ``head`` read
0 there; the step's remainder is the head).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from verispec.bench.measure import core_roundtrip_ns, placement_groups
from verispec.models import fast_llama
from verispec.models.loading import load_model
from verispec.models.schedule import _calls

PARTS = ["plan", "norms", "qkv", "write_kv", "attn", "wo", "gu", "swiglu", "down", "final", "head"]

# Each statement of a layer's loop in `FastLlamaKernel::run`, and the part (index into PARTS) the
# time up to its end is charged to.
_LAYER = [
    ("Normed in = normed(L.wqkv, q, L.in_norm);", 1),
    ("product_normed(L.wqkv, in, QKV, opt(L.bqkv), qkv, heads_at);", 2),
    ("if (!heads_at) write_kv(l, M, sl, ps, cos, sin);", 3),
    ("attention(l, M, ps, qa);", 4),
    ("residual_product(L.wo, att_.data(), HQD, opt(L.bo), qa);", 5),
    ("in = normed(L.wgu, q, L.post_norm);", 1),
    ("product_normed(L.wgu, in, 2 * I, nullptr, gu_.data(), &swiglu_done);", 6),
    ("product_normed(L.wgu, in, 2 * I, nullptr, gu_.data(), nullptr);", 6),
    ("swiglu(M, I, qd);", 7),
    ("residual_product(L.wdown, act_.data(), I, nullptr, qd);", 8),
]
_CLOCK = """#include <vector>
#include <chrono>
static double g_parts[16];
static inline double now_us() {
  const auto t = std::chrono::steady_clock::now().time_since_epoch();
  return std::chrono::duration<double, std::micro>(t).count();
}
#define PART(i) { const double t_ = now_us(); g_parts[i] += t_ - last_; last_ = t_; }
"""
_HEAD = "    if (R > 0) head_logits<WT>(sel.data(), R, logits.data_ptr<float>());\n    return logits;"


def instrument(source: str) -> str:
    """The kernel source with the part clocks and a module function ``parts()`` (the microseconds
    summed per part since the last call, [16], then reset). Raises if the source's forward no longer
    has the statements this expects."""
    out = source.replace("#include <vector>\n", _CLOCK, 1)
    for stmt, part in _LAYER:
        line = f"      {stmt}\n"
        if out.count(line) != 1:
            raise SystemExit(f"the kernel's forward changed: no single line {stmt!r}")
        out = out.replace(line, f"      {stmt} PART({part})\n")
    start = "    plan_attention(M, sl);\n"
    if start not in out or _HEAD not in out:
        raise SystemExit("the kernel's forward changed: no plan_attention or head call where expected")
    timed = "    double last_ = now_us();\n    plan_attention(M, sl);\n    PART(0)\n"
    out = out.replace(start, timed, 1)
    out = out.replace(_HEAD, "    PART(9)\n" + _HEAD.replace("\n", "\n    PART(10)\n", 1), 1)
    module = '  m.def("amx_ready", &amx_ready);'
    return out.replace(
        module,
        module + '\n  m.def("parts", []() { std::vector<double> v(g_parts, g_parts + 16); '
        "for (auto& t : g_parts) t = 0; return v; });",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="int8")
    ap.add_argument("--model", default="default")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--amx-rows", type=int, nargs="+", default=[])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--source", type=Path, default=fast_llama._SRC)
    ap.add_argument("--placement", action="store_true", help="split rounds by the cores' placement")
    ap.add_argument("--blocks", type=int, default=40, help="rounds, with --placement")
    ap.add_argument("--columns", action="store_true", help="wide int8/int4/w4a8 calls by columns, not rows")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "fast_llama.cpp"
        src.write_text(instrument(args.source.read_text()))
        fast_llama._SRC = src
        module = fast_llama.compile_kernel(fast_llama.kernel_flags())[0]
    fast_llama._kernel_module = module
    model = load_model(args.model, dtype=args.dtype, max_length=args.context + 2 * max(args.widths))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (1, args.context + max(args.widths)), generator=gen)  # [1, C+W]
    if args.columns:
        model._kernel.set_rows(False)
    model.reset(1)
    model.forward(ids[:, : args.context], logits="none")
    back = torch.tensor([args.context])
    calls = _calls(model, ids, args.context, args.widths, "greedy")
    by_rows: set[int] = set()  # widths whose calls ran their layers by rows (parts not clocked)

    def timed(w: int, warm: int = 5) -> tuple[list[float], list[float]]:
        """Seconds of each of ``--steps`` steps of w tokens, and us per step in each part."""
        before = model._kernel.rows_calls()
        for _ in range(warm):
            calls[w]()
            model.truncate(back)
        if model._kernel.rows_calls() > before:
            by_rows.add(w)
        module.parts()
        secs = []
        for _ in range(args.steps):
            start = time.perf_counter()
            calls[w]()
            secs.append(time.perf_counter() - start)
            model.truncate(back)
        return secs, [p / args.steps for p in module.parts()]

    def line(label: str, w: int, lo: float, mid: float, parts: list[float]) -> str:
        names = " ".join(f"{name} {parts[i]:.0f}" for i, name in enumerate(PARTS))
        if w in by_rows:
            names += " (by rows: parts not clocked; --columns)"
        return f"{label}{w} tokens: {lo * 1e3:.2f} / {mid * 1e3:.2f} ms; us: {names}"

    if args.placement:
        rounds = []  # (round trip ns, {w: (min s, median s, parts)})
        for _ in range(args.blocks):
            rt = core_roundtrip_ns() or 0.0
            got = {}
            for w in args.widths:
                secs, parts = timed(w, warm=1)
                got[w] = (min(secs), statistics.median(secs), parts)
            rounds.append((rt, got))
        times = [rt for rt, _ in rounds]
        split = placement_groups(times)
        if split is None:  # one placement all along (or none read): one group, named by its round trips
            split = {f"{min(times):.0f}-{max(times):.0f} ns": list(range(len(rounds)))}
        for name, indices in split.items():
            some = [rounds[i] for i in indices]
            rt = statistics.median(r for r, _ in some)
            for w in args.widths:
                lo = statistics.median(g[w][0] for _, g in some)
                mid = statistics.median(g[w][1] for _, g in some)
                parts = [statistics.median(g[w][2][i] for _, g in some) for i in range(len(PARTS))]
                print(line(f"{name} ({len(some)} rounds, {rt:.0f} ns) ", w, lo, mid, parts), flush=True)
        return
    for rows in args.amx_rows or [None]:
        if rows is not None:
            model._kernel.set_amx_rows(rows)
        for w in args.widths:
            secs, parts = timed(w)
            label = f"amx_rows={rows} " if rows is not None else ""
            print(line(label, w, min(secs), statistics.median(secs), parts), flush=True)


if __name__ == "__main__":
    main()
