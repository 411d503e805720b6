"""A fast ``KVModel`` for Llama-style decoders (Llama, SmolLM2, Mistral, Qwen2).

The algorithm is the plain pre-norm Llama decoder (Touvron et al., 2023, "LLaMA: Open and Efficient
Foundation Language Models"): RMSNorm, grouped-query attention with rotary position embeddings
(Su et al., 2021, "RoFormer"), a SwiGLU MLP, tied or untied output head. Weights are taken from a
loaded Hugging Face model and repacked: q/k/v fused into one ``[(H_q + 2 H_kv) D, hidden]`` matrix and
gate/up into one ``[2 I, hidden]`` matrix, so one weight pass serves each.

Two paths run the same model on the same preallocated caches:

* the **kernel** path (``verispec/csrc/fast_llama.cpp``, AVX2/FMA, compiled at first use) runs the
  whole forward in one C++ call. It is used for calls of at most ``kernel_max_tokens`` new tokens
  per row: decoding and draft verification, where the cost is reading the weights once; and for
  prompts up to a length measured per machine (``kernel_prefill_max``), in pieces of
  ``kernel_prefill_piece`` tokens, each reading the weights once.
* the **torch** path (matmuls and ``scaled_dot_product_attention``) is used for long prefills,
  which are compute-bound, on non-CPU devices, and as the fallback when the kernel cannot be built
  (no compiler, no AVX2, or ``VERISPEC_NO_KERNEL=1``). With bfloat16 or int8 weights, long
  prefills run their matrix products in bfloat16 where the hardware has it natively
  (``prefill_compute``): a 700-token prompt on the 2-core EPYC took int8 1.4 -> 1.0 s, bfloat16
  1.8 -> 0.9 s (float32 weights: 1.3 s, unchanged). Top-1 agreement with float32 over 4455 prompt
  positions: int8 96.2% -> 95.8%, bfloat16 99.6% -> 97.7%. Their attention runs in bfloat16 too
  (session 12, 2-core Xeon with AMX: 700 tokens int8 0.56-0.79 -> 0.46-0.51 s, 1500 tokens
  1.33-1.36 -> 0.90-1.06 s; top-1 agreement with float32 over 6486 positions of 40 Spec-Bench
  prompts unchanged: int8 94.26% -> 94.36%, bfloat16 97.81% -> 97.81%). Their norms, rotary
  embeddings and SwiGLU activation run as the kernel's fused ops (session 16, the Xeon: 769 tokens
  int8, median 985 -> 833 ms; bfloat16 853 -> 720 ms; the same 6486 positions: int8 94.62% ->
  94.65%, bfloat16 97.21% -> 97.09%, mean KL unchanged).

Exactness: on the kernel path every output element is reduced in an order that depends only on its
own inputs, so a token's logits are bitwise identical whether it is fed alone or together with
draft tokens (any ``T <= kernel_max_tokens``), in any batch, with any thread count. Speculative
greedy decoding therefore equals plain greedy decoding token for token. The torch path matches the
Hugging Face model to float32 rounding but its matmuls may pick different kernels for different
``T``, so it only guarantees closeness, not bitwise equality.

Measured (``benchmarks/fast_forward.py --no-hf --no-torch``, SmolLM2-135M, 2-core EPYC, context 64,
median ms for T = 1 / 5 new tokens, session 4, with the kernel's L2 prefetch): float32 22.1 / 20.9
(538 MB read per step: 24 GB/s, 91% of the 26.8 GB/s this machine's ``memory_bandwidth`` measured
in the same minute); bfloat16 11.5 / 15.4 (compute-bound beyond one token: widening costs two
instructions per 8 weights); int8 then 6.8 / 13.8, and since session 5, with int16 activations and
integer products, 7.4-8.3 / 10.8-13.1 in runs interleaved with the old build's 8.2-8.3 / 18.0-24.3.
Before (L1 prefetch every 32 bytes, same script, same hour): float32 36.1 / 40.2, bfloat16 22.6 /
28.4, int8 10.1 / 15.4. Earlier, HF eager 66 / 107 and the torch path float32 63 / 75. Session 9
(tiles of two weight pairs in all 32 AVX-512 registers, context 200, a slow-memory phase): int8
5.2-6.3 / 6.7-8.1, float32 17.5-20.3 / 20.1-23.5. In the machine's fast-memory phases one token
gets faster and five do not: float32 about 12 / 16-17.6, int8 5.0 / 8.6 (benchmarks/SESSIONS.md).

Which tiles serve passes of few rows, and whether a one-row pass prefetches in software, is chosen
per machine by timing (``kernel_schedule``, :mod:`verispec.models.schedule`): the EPYC's defaults
cost a 2-core Intel Xeon (session 11) 10-25% at one row. So is the longest prompt the kernel takes
before the torch path is faster (``kernel_prefill_max``; on that Xeon float32 ~190 tokens, int8
~130, bfloat16 ~50, where the EPYC's defaults said 96 for all three).

Weight formats (``DTYPES``): int8 is symmetric with one float32 scale per weight row; on the
kernel path it multiplies activations quantised per row to int16 (see the C++ source), which left
top-1 agreement with float32 at 95.56% against 95.54% with float32 activations (5721 positions of
40 Spec-Bench prompts). Against float32 on 1292 positions of Spec-Bench prompts, the top-1 token
agrees at 96.1% (bfloat16: 99.7%), mean KL 0.006 nats (bfloat16: 0.0001). Groups of 32 along K
would give 97.7% / 0.002 (simulated) at the cost of a multiply per weight vector and 12% more bytes.
int4 (session 41) is a Q4_1 model's own weights, exact: the kernel multiplies the layers' 4-bit
codes (``linear_q4_tiles``; 6 bits a weight) and the head's Q8_0 codes (``q8_tile``) by the same
int16 activations in integers, block by block, and reads embedding rows from the Q8_0 blocks. On
the prompt positions of 39 Spec-Bench prompts (7148, the first 3 of each category) its top-1 token
agreed with float32's at 99.96% (int8 96.11%; with an int8 head it was 98.29%), mean KL 2.1e-6 nats
(int8 5.2e-3). It has no torch path: every call runs on the kernel, which needs AVX-512 VNNI for it.
w4a8 (session 42) holds int4's weights and rounds the activations of its products to 8 bits per
block of 32 instead (``q4a8_tile``): one ``vpdpbusd`` per 4 weights and row, half of int4's, so
wide calls (prompts, verification) cost less; top-1 agreement 97.13%, mean KL 3.3e-3 nats on the
same positions (``benchmarks/format_agreement.py``).
On a CPU with AMX (Intel Xeon since Sapphire Rapids; :func:`amx_enabled`) the kernel also holds the
int8 matrices as AMX tiles (a second copy of the int8 weights, on 2 MB pages) and multiplies calls
of at least ``amx_rows`` tokens there, bitwise the same integers. By default those are prompts:
decoding steps stay on the VNNI tiles, since switching paths from step to step cost more than the
tiles saved (``schedule.AMX_ROWS`` has the figures). On the 2-core Xeon an int8 prompt of 700
tokens took 262-275 ms on the tiles against 557-581 on the VNNI tiles. ``VERISPEC_AMX=0`` turns the
tiles off, ``VERISPEC_AMX_ROWS=N`` sets the width (1: verification too; generation ran slower that
way there). On a CPU with AVX-512 VNNI but no AMX (AMD's Zen 4 and Zen 5; :func:`vnni_tiles_enabled`)
the layers' int8 matrices are held in the same tile layout and the same wide calls multiply them
with ``vpdpbusd`` (the kernel's ``linear_vnni_tiles``), bitwise the same outputs: on a 2-core Zen 4
EPYC a 769-token int8 prompt took 624-675 ms against 767-828 on the pair tiles (session 40).
``VERISPEC_VNNI_TILES=0`` turns them off.

Cache invariant (see ``base.py``): row ``r`` holds ``lengths[r]`` tokens at positions
``0 .. lengths[r] - 1`` of its slice of every ``[B, H_kv, S, D]`` cache; ``truncate`` only lowers the
length, and the next write overwrites what lay past it. The attention of a query at position ``p``
reads keys ``0 .. p`` only.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from verispec.models import schedule
from verispec.models.base import LogitsMode, logit_rows, tensor_bytes
from verispec.models.pages import huge_page_bytes
from verispec.models.threads import ThreadTuner
from verispec.rejection import forward_argmax

logger = logging.getLogger(__name__)

_SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "bfloat16", "int8", "int4", "w4a8")
"""Weight formats of ``FastLlama.from_hf`` (the matrices only; everything else stays float32)."""
KERNEL_ONLY_DTYPES = ("int4", "w4a8")
"""Formats whose layers the kernel alone holds (a Q4_1 model's own 4-bit blocks, against int16
activations for int4, 8-bit blocks of activations for w4a8): no torch path serves them."""
# RoPE variants whose frequencies do not depend on the sequence length, so a precomputed table is
# exact. ("dynamic" and "longrope" rescale with the length and are not supported.)
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_SRC = Path(__file__).resolve().parent.parent / "csrc" / "fast_llama.cpp"
_kernel_module: Any = None
_kernel_error: str | None = None


def _load_kernel() -> Any:
    """Compile (once per source version, cached under ~/.cache/verispec) and import the kernel.

    Returns the extension module, or None (with one logged warning) when it cannot be built.
    """
    if _kernel_module is not None or _kernel_error is not None:
        return _kernel_module
    with _kernel_lock:  # another thread may be compiling it (compile_kernel_meanwhile): wait for it
        return _load_kernel_once()


def _load_kernel_once() -> Any:
    global _kernel_module, _kernel_error
    if _kernel_module is not None or _kernel_error is not None:
        return _kernel_module
    try:
        _kernel_module, build = _compile_with_fallback(kernel_flags())
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        _kernel_error = f"{type(exc).__name__}: {exc}"
        logger.warning("verispec fast kernel unavailable, using torch matmuls: %s", _kernel_error)
        return None
    try:
        prune_kernel_builds(build)
    except OSError as exc:  # a read-only or shared cache: keep every build
        logger.debug("verispec: old kernel builds not pruned: %s", exc)
    return _kernel_module


_kernel_lock = threading.Lock()


def kernel_version() -> str:
    """The first 12 hex digits of the kernel source's SHA-256: what its timed choices
    (``verispec.models.schedule``) were measured on, so a changed kernel is timed again. Read each
    time (a millisecond, at a model's load), so it follows ``_SRC`` where the benchmarks swap it."""
    return hashlib.sha256(_SRC.read_bytes()).hexdigest()[:12]


def loaded_kernel() -> Any:
    """The kernel module if this process has already built and imported it, else None (never
    builds it: the sampling transform uses it only where a fast model already did)."""
    return _kernel_module


def compile_kernel_meanwhile(architecture: str | None) -> threading.Thread | None:
    """Start loading the kernel (compiling it on first use) on another thread for a model of
    ``architecture`` (GGUF's ``general.architecture``), and return the thread; None where the
    fast path does not take that architecture, or the kernel is loaded already or turned off
    (``VERISPEC_NO_KERNEL``).

    For a first load that converts a GGUF file first (18 s here, on one core): the compiler runs on
    the other core meanwhile, and the model's own :func:`_load_kernel` waits for it. The thread is
    not a daemon: a process that ends meanwhile waits for the build to finish rather than leave a
    half-written build directory and its lock behind.
    """
    if architecture not in _SUPPORTED_TYPES or _kernel_module is not None or _kernel_error is not None:
        return None
    if _kernel_turned_off():
        return None
    thread = threading.Thread(target=_load_kernel, name="verispec-kernel-build")
    thread.start()
    return thread


KERNEL_BASE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
"""What every build of the kernel needs; :func:`kernel_flags` adds the AVX-512 flags the CPU has."""


def kernel_flags() -> list[str]:
    """The compiler flags the kernel is built with on this CPU: :data:`KERNEL_BASE_FLAGS`, plus
    AVX-512 where torch finds it. Raises RuntimeError on a CPU without AVX2."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise RuntimeError(f"CPU capability is {capability}, the kernel needs AVX2 and FMA")
    flags = list(KERNEL_BASE_FLAGS)
    if capability == "AVX512" and getattr(torch.cpu, "_is_vnni_supported", lambda: False)():
        # int8 products in one instruction, not two (and with AVX-512BW, for two weight rows)
        flags += ["-mavx512vnni", "-mavx512vl", "-mavx512bw"]
    if capability == "AVX512":
        flags += ["-mavx512f"]  # float32 products in 512-bit tiles
        if _cpu_has("avx512_bf16"):
            flags += ["-mavx512bf16"]  # the optional bfloat16 attention of int4 and w4a8 (`_kv_dtype`)
    if _cpu_has("amx_tile", "amx_int8"):
        flags += list(AMX_FLAGS)  # int8 products on AMX tiles (`set_amx`)
    return flags


def amx_enabled() -> bool:
    """Whether int8 models get AMX tiles for their wide calls (``FastLlama.amx_rows``): the kernel
    was built with them, the OS lets this process use them, and ``VERISPEC_AMX`` is not ``0``. On
    such a CPU (Intel Xeon since Sapphire Rapids) the int8 weights are then held twice (pairs and
    tiles)."""
    if os.environ.get("VERISPEC_AMX", "1") == "0":
        return False
    ready = getattr(_load_kernel(), "amx_ready", None)  # None: no kernel, or a build before AMX
    return ready is not None and bool(ready())


def vnni_tiles_enabled() -> bool:
    """Whether int8 models on a CPU without AMX get the AMX tiles' layout for their wide calls,
    multiplied with AVX-512 VNNI (``FastLlama.amx_rows``; AMD's Zen 4 and Zen 5, Intel's Ice Lake):
    the kernel was built with VNNI, the CPU has no AMX, and ``VERISPEC_VNNI_TILES`` is not ``0``.
    The layers' int8 weights are then held twice (pairs and tiles; not the head's)."""
    if os.environ.get("VERISPEC_VNNI_TILES", "1") == "0":
        return False
    kernel = _load_kernel()
    if kernel is None or bool(getattr(kernel, "amx_ready", lambda: False)()):
        return False  # where AMX is, its tiles serve (or with VERISPEC_AMX=0, none)
    return bool(getattr(kernel, "vnni_tiles_ready", lambda: False)())  # False: a build before them


AMX_FLAGS = ("-mamx-tile", "-mamx-int8")


def _compile_with_fallback(flags: Sequence[str]) -> tuple[Any, Path]:
    """:func:`compile_kernel` with ``flags``; where that fails with the AMX flags in them (a compiler
    older than GCC 11 or Clang 12 does not know them), once more without: the kernel without the
    tiles rather than none."""
    try:
        return compile_kernel(flags)
    except Exception as exc:  # noqa: BLE001 - retried below, raised if it fails again
        plain = [f for f in flags if f not in AMX_FLAGS]
        if len(plain) == len(flags):
            raise
        logger.warning("the kernel did not build with AMX (%s); building it without", exc)
        return compile_kernel(plain)


def _cpu_has(*names: str) -> bool:
    """Whether /proc/cpuinfo lists every flag in ``names`` (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(names) <= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return False


def compile_kernel(flags: Sequence[str]) -> tuple[Any, Path]:
    """Compile the kernel with compiler ``flags`` (once per source version, flags and checkout,
    cached under the verispec cache) and import it: the module and its build directory.

    :func:`_load_kernel` builds with the flags this CPU allows; a test builds without AVX-512 too,
    to check that those tiles give the same bits."""
    from torch.utils.cpp_extension import load

    from verispec.models.loading import cache_dir

    # The name carries the source hash so processes running different versions never share (or
    # fight over) one build directory, and the source's path, since ninja rebuilds when the same
    # source comes from another checkout.
    key = _SRC.read_bytes() + " ".join(flags).encode() + str(_SRC).encode()
    name = f"verispec_fast_llama_{hashlib.sha256(key).hexdigest()[:12]}"
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob(f"{name}*.so")):
        logger.warning("compiling the fast kernel once (about a minute; cached in %s)", build)
    module = load(
        name=name,
        sources=[str(_SRC)],
        extra_cflags=list(flags),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )
    return module, build


KERNEL_BUILD_MAX_AGE_DAYS = 30.0
"""Kernel builds (one per source version, flags and checkout) unused for this long are removed."""


def prune_kernel_builds(current: Path, max_age_days: float = KERNEL_BUILD_MAX_AGE_DAYS) -> list[Path]:
    """Mark the build directory ``current`` as used now, and remove its siblings (other
    ``verispec_fast_llama_*`` builds, about 2 MB each) last used more than ``max_age_days`` ago.

    Every upgrade and every checkout in another place makes a new build; without this the cache
    grows by one per version forever. A process still running an old build keeps it: the loaded
    library stays mapped after its file is removed. Returns the directories removed.
    """
    stamp = current / "last_used"
    stamp.touch()
    cutoff = time.time() - max_age_days * 86400
    removed = []
    for build in current.parent.glob("verispec_fast_llama_*"):
        if build == current or not build.is_dir():
            continue
        marker = build / "last_used"  # builds from before the marker: when they were built
        try:
            used = (marker if marker.exists() else build).stat().st_mtime
        except OSError:
            continue  # removed meanwhile by another process
        if used < cutoff:
            shutil.rmtree(build, ignore_errors=True)
            removed.append(build)
    return removed


def _kernel_turned_off() -> bool:
    """Whether ``VERISPEC_NO_KERNEL`` turns the C++ kernel off (any value but empty or 0)."""
    return os.environ.get("VERISPEC_NO_KERNEL", "") not in ("", "0")


def kernel_available() -> bool:
    """Whether the C++ kernel compiled and loaded on this machine (compiles it if needed)."""
    return not _kernel_turned_off() and _load_kernel() is not None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm in float32: ``weight * (x * rsqrt(mean(x^2) + eps))``; x ``[..., hidden]``."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    compute: torch.dtype | None = None,
) -> torch.Tensor:
    """``(x @ weight.T) * scale + bias``; x ``[..., K]``, weight ``[N, K]``; float32 out.

    The product runs in ``compute`` (default: x's dtype). bfloat16 and int8 weights are converted
    exactly to it first (a temporary copy: this path serves long prefills, where the matmul
    dominates; int8's -127..127 are exact in bfloat16). With ``compute=torch.bfloat16`` the
    activations are rounded to bfloat16 and the product's output too (oneDNN's native bfloat16
    path, about 2.3x float32's rate on a CPU with AVX512-BF16). ``scale`` ``[N]`` (int8 only)
    multiplies the finished dot products, in the kernel's order, rather than the weights.
    ``x`` may already be in ``compute`` (bfloat16 attention outputs); the result is float32 either
    way.
    """
    if scale is None and (compute or x.dtype) == torch.float32:
        return _product(x, weight, compute, bias)  # the bias added by the product itself
    y = _product(x, weight, compute).float()  # widened (a no-op for float32), then times the scale
    # in place: the same values as the type-promoting y * scale, which took twice as long for a
    # bfloat16 y (1.28 -> 0.63 ms for 769 x 3072 here)
    if scale is not None:
        y.mul_(scale)
    return y if bias is None else y + bias


ROWS_SPLIT_MOST_COLUMNS = 768
ROWS_SPLIT_FROM = 512
"""bfloat16 products (long prompts) of at most ``ROWS_SPLIT_MOST_COLUMNS`` output columns and at
least ``ROWS_SPLIT_FROM`` rows go through the kernel's ``linear_rows``: the rows split over the
threads, one oneDNN call each. oneDNN (torch 2.13, the 2-core Xeon of session 39) ran such
products on one thread for many row counts. x [M, K] @ [576, K]^T, ms, ``F.linear`` /
``linear_rows``: K = 576, M = 640 0.33 / 0.20, 769 0.39 / 0.23, 1024 0.51 / 0.29, 2048 0.52 / 0.53;
K = 1536, M = 500 0.86 / 0.50, 769 1.18 / 0.75, 1200 1.73 / 0.95, 2048 1.56 / 1.60. With more
columns oneDNN's own threads did better (3072 x 576, M = 769: 1.08 / 1.42), and below 512 rows too
(M = 400, 576 x 576: 0.13 / 0.17). Whole int8 prompts (SmolLM2-135M, medians of 10 alternating
rounds): 656 tokens 268 -> 273 ms, 769 304 -> 285, 848 326 -> 301, 1334 515 -> 504."""


def _product(
    x: torch.Tensor,
    weight: torch.Tensor,
    compute: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in ``compute`` (default: x's dtype), no scale applied: ``[..., N]``
    in that dtype; x ``[..., K]``, weight ``[N, K]`` (converted exactly, as in :func:`_linear`).
    Long bfloat16 products of few columns split their rows over the threads (``ROWS_SPLIT_FROM``)."""
    if compute is not None and compute != x.dtype:
        x = x.to(compute)
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if (
        bias is None
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and _kernel_module is not None
        and weight.shape[0] <= ROWS_SPLIT_MOST_COLUMNS
        and x.numel() >= ROWS_SPLIT_FROM * x.shape[-1]
    ):
        flat = _kernel_module.linear_rows(x.reshape(-1, x.shape[-1]).contiguous(), weight)  # [rows, N]
        return flat.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, kernel: Any, compute: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`_rms_norm` of ``x`` ``[..., hidden]`` (float32); with ``kernel`` (the compiled module;
    on the CPU only) its ``rmsnorm_bf16`` for bfloat16 products (``compute``), the same arithmetic
    in one pass, rounded to bfloat16 for the next product, or ``rmsnorm_f32`` (float32 out)."""
    if kernel is None:
        return _rms_norm(x, weight, eps)
    op = kernel.rmsnorm_bf16 if compute == torch.bfloat16 else kernel.rmsnorm_f32
    flat = op(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps)  # [rows, hidden]
    return flat.view(x.shape)


def _swiglu_linear(
    x: torch.Tensor,
    wgu: torch.Tensor,
    scale: torch.Tensor | None,
    compute: torch.dtype | None,
    kernel: Any,
) -> torch.Tensor:
    """The SwiGLU MLP's activation ``silu(gate) * up`` of ``gu = x @ wgu.T`` (times ``scale``):
    x ``[..., hidden]``, wgu ``[2 I, hidden]`` (gate rows, then up rows) -> ``[..., I]``.

    With ``kernel`` (the compiled module; on the CPU only), the kernel's ``swiglu`` applies the
    scale, the activation and the product in one pass over the products and returns them in their
    dtype: bfloat16 for bfloat16 products, the next product's input (eager torch made five passes
    and two float32 copies: a long int8 prefill spent about a fifth of its time there), float32 for
    float32 ones. Otherwise the float32 result, as :func:`_linear` gives it.
    """
    if kernel is not None:
        gu = _product(x, wgu, compute)  # [..., 2 I] in compute (bfloat16 or float32)
        flat = kernel.swiglu(gu.reshape(-1, gu.shape[-1]), scale)  # [rows, I] bfloat16
        return flat.view(*gu.shape[:-1], -1)
    gate, up = _linear(x, wgu, scale=scale, compute=compute).chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate) * up


_LAYER_MATRICES = ("wqkv", "wo", "wgu", "wdown")


def _pair_chunk(weight: torch.Tensor) -> int:
    """Weights per chunk of the kernel's pair-interleaved layout (one load: 16 int8, else 8)."""
    return 16 if weight.dtype == torch.int8 else 8


def _pairs_ok(weight: torch.Tensor) -> bool:
    """The kernel's ``paired_ok``: whole pairs of rows and whole chunks."""
    n, k = weight.shape
    return n % 2 == 0 and k % _pair_chunk(weight) == 0


def _interleave_pairs(weight: torch.Tensor) -> None:
    """Rearrange ``weight`` ``[N, K]`` in place into the kernel's pair-interleaved layout: rows 2p and
    2p + 1 alternate in chunks of C weights, ``[N / 2][K / C][2][C]`` (see ``kPairChunk`` in the
    kernel). The tensor keeps its shape; only ``_plain_rows`` reads it as rows again."""
    n, k = weight.shape
    c = _pair_chunk(weight)
    weight.copy_(weight.view(n // 2, 2, k // c, c).transpose(1, 2).reshape(n, k).clone())


def _plain_rows(weight: torch.Tensor) -> torch.Tensor:
    """A row-major copy ``[N, K]`` of a pair-interleaved ``weight`` (the inverse of ``_interleave_pairs``)."""
    n, k = weight.shape
    c = _pair_chunk(weight)
    return weight.view(n // 2, k // c, 2, c).transpose(1, 2).reshape(n, k)


SCREEN_GAMMA = 2 * 576 * 2.0**-24
"""Bound on the float32 head's relative rounding: ``|l_j - h . E_j| <= SCREEN_GAMMA ||h|| ||E_j||``
for hidden sizes up to 576 (each logit is 8 chains of K / 8 fused multiply-adds and a sum of the 8:
fewer than K roundings of at most 2^-24; twice that, for margin). ``_head_screen`` scales it to H."""


SCREEN_CHUNK_ROWS = 2048
"""Rows of the head that ``_head_screen`` works on at a time."""


def _head_screen(head: torch.Tensor) -> dict[str, torch.Tensor]:
    """The kernel's greedy screen of a float32 head ``head`` ``[V, H]`` (row-major): int8 codes
    ``c`` ``[V, H]`` with per-row scales ``s`` ``[V]`` (``s_j = max |E_j| / 127``, codes rounded to
    nearest), and the bound coefficients ``wnorm`` ``[V]`` >= ``||s_j c_j||`` and ``resid`` ``[V]``
    >= ``||E_j - s_j c_j|| + gamma ||E_j||``, all float32, computed in float64 and rounded up.

    A greedy step reads the codes (a quarter of the head's bytes) and only the float32 rows of the
    few tokens whose screened logit, give or take its bound, could still be the largest (the
    kernel's ``screened_head``); the argmax is exactly the whole head's.
    """
    h = head.shape[1]
    gamma = SCREEN_GAMMA * max(1.0, h / 576)

    def up(x: torch.Tensor) -> torch.Tensor:  # float32 at or above every value (and 1e-12 margin)
        f = (x * (1 + 1e-12)).float()
        return torch.where(f.double() < x, torch.nextafter(f, torch.full_like(f, torch.inf)), f)

    parts: dict[str, list[torch.Tensor]] = {"codes": [], "scale": [], "wnorm": [], "resid": []}
    # Rows a chunk at a time: every figure is per row, and float64 temporaries of a few MB stay in
    # the allocator's cache where whole-head ones (226 MB for SmolLM2) were faulted in anew each
    # time (2.9 s -> about 1 s at load).
    for rows in head.detach().split(SCREEN_CHUNK_ROWS):
        e = rows.double()  # [n, H]
        scale = (e.abs().amax(dim=1) / 127.0).float()  # the float32 scale the kernel multiplies by
        s64 = scale.double()
        codes = torch.where(s64[:, None] > 0, torch.round(e / s64.clamp_min(1e-300)[:, None]), 0.0)
        codes = codes.clamp(-127, 127)
        deq = s64[:, None] * codes  # [n, H], exact in float64 (an int times a float32)
        parts["codes"].append(codes.to(torch.int8))
        parts["scale"].append(scale)
        parts["wnorm"].append(up(deq.norm(dim=1)))
        parts["resid"].append(up((e - deq).norm(dim=1) + gamma * e.norm(dim=1)))
    return {k: torch.cat(v).contiguous() for k, v in parts.items()}


def _as_rows(weight: torch.Tensor, paired: bool) -> torch.Tensor:
    """``weight`` ``[N, K]`` row-major: a copy read from the pairs when ``paired`` and ``_pairs_ok``
    (the kernel's layout), else ``weight`` itself."""
    return _plain_rows(weight) if paired and _pairs_ok(weight) else weight


def _rows_for(
    weight: torch.Tensor,
    paired: bool,
    compute: torch.dtype | None,
    kernel: Any,
    buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``weight`` ``[N, K]`` row-major for a product in ``compute`` (see :func:`_product`).

    From the pairs (``paired`` and ``_pairs_ok``) with ``kernel`` (the compiled module): its
    ``rows_from_pairs``, one pass that also widens int8 to bfloat16 when the product runs in
    bfloat16 (int8's -127..127 are exact there), so ``_product`` converts nothing. Eager torch took
    two passes and moved the pairs' 8-weight chunks in short strided loops: SmolLM2-135M's layers
    on the Xeon, 6 rounds, float32 62-69 -> 43-49 ms, int8 to bfloat16 37-51 -> 18-20 ms.
    With ``buffers`` (shape and dtype -> tensor, filled on first use) the copy is written into the
    buffer of its shape, overwriting the previous one's: the memory is mapped once, not on every
    call (an 85-token float32 prompt, 8 rounds: 255 -> 231 ms). Copies of the same type are
    written past the caches (``stream``: non-temporal stores), which leaves the caches to the
    product's inputs: SmolLM2-135M's float32 layers within a 210-token prefill on the Xeon, 6
    rounds, copies 76-92 -> 46-62 ms with the products unchanged. Otherwise :func:`_as_rows`.
    """
    if kernel is None or not (paired and _pairs_ok(weight)):
        return _as_rows(weight, paired)
    to_bf16 = weight.dtype == torch.int8 and compute == torch.bfloat16
    into = None
    if buffers is not None:
        key = (tuple(weight.shape), torch.bfloat16 if to_bf16 else weight.dtype)
        into = buffers.get(key)
        if into is None:
            into = buffers[key] = torch.empty(key[0], dtype=key[1], device=weight.device)
    return kernel.rows_from_pairs(weight, to_bf16=to_bf16, into=into, stream=True)


def _rows_at(weight: torch.Tensor, ids: torch.Tensor, paired: bool) -> torch.Tensor:
    """Rows ``ids`` (any shape) of ``weight`` ``[N, K]``, pair-interleaved when ``paired`` and
    ``_pairs_ok``: ``[*ids.shape, K]``."""
    if not (paired and _pairs_ok(weight)):
        return weight[ids]
    n, k = weight.shape
    c = _pair_chunk(weight)
    return weight.view(n // 2, k // c, 2, c)[ids // 2, :, ids % 2].reshape(*ids.shape, k)


def _native_bfloat16(device: torch.device) -> bool:
    """Whether bfloat16 matrix products run natively (not emulated) on ``device``: a CUDA GPU, or
    a CPU whose oneDNN build supports its bfloat16 instructions (AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an older or stripped build
        return False


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row: ``w ~= q * scale[:, None]``.

    Args:
        w: ``[N, K]`` float32.

    Returns:
        ``q`` ``[N, K]`` int8 in -127..127 and ``scale`` ``[N]`` float32 (``max |w[n]| / 127``; an
        all-zero row gets scale 0).
    """
    amax = w.abs().amax(dim=1)  # [N]
    scale = amax / 127.0
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127)
    return q.to(torch.int8).contiguous(), scale.contiguous()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: float32 ``a`` and ``b`` hold the same bits (unlike ``==``, -0.0 is not 0.0)."""
    return a.view(torch.int32) == b.view(torch.int32)


def _q4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The exact 4-bit blocks of a float32 matrix, or None where it has none.

    GGUF's Q4_1 stores each block of 32 weights as ``d * q + m`` with ``q`` in 0..15 and ``d``,
    ``m`` float16; transformers dequantises it to float32, and ``d * q`` is exact there, so every
    weight is the one rounding of ``d * q + m``. Here ``m`` is the block's minimum (its ``q = 0``
    element) and ``d`` the float16 step nearest ``(max - min) / 15`` or one of its neighbours; a
    block counts only if rebuilding it gives every weight back bitwise, and the matrix only if every
    block does (the kernel then reads them instead of the float32 rows: ``linear_blocks``).

    Args:
        w: ``[N, K]`` float32, ``K % 32 == 0`` and ``N`` even (else None: the kernel reads weight
            rows in pairs).

    Returns:
        ``q`` ``[N, K / 32, 16]`` uint8 (``q[i]`` in the low nibble of byte ``i``, ``q[i + 16]`` in
        its high nibble, as GGUF packs them) and ``dm`` ``[N, K / 32, 2]`` float32 (``d``, ``m``).
    """
    n, k = w.shape
    if w.dtype != torch.float32 or k % 32 or n % 2 or not bool(torch.isfinite(w).all()):
        return None
    blocks = w.reshape(n, k // 32, 32)
    low = blocks.amin(dim=-1)  # [N, K / 32]
    if not bool((low.half().float() == low).all()):
        return None
    step = ((blocks.amax(dim=-1) - low) / 15).half()

    def rebuild(
        part: torch.Tensor, lo: torch.Tensor, cand: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes of blocks ``part`` [..., 32] for minimum ``lo`` and step ``cand`` [...], and
        whether each block comes back bitwise."""
        cand = cand.clamp(min=0.0)
        qc = (part - lo[..., None]).div_(torch.where(cand > 0, cand, 1.0)[..., None]).round_().clamp_(0, 15)
        qc = (qc * (cand > 0)[..., None]).to(torch.uint8)  # the codes as the kernel holds them
        ok = _same_bits(cand[..., None] * qc.float() + lo[..., None], part).all(dim=-1)
        return qc, ok

    q, ok = rebuild(blocks, low, step.float())  # the nearest step rebuilds nearly every block
    d = step.float().clamp(min=0.0)
    left = ~ok
    for nudge in (1, -1, 2, -2):  # the rest: neighbouring float16 steps
        idx = left.nonzero(as_tuple=True)
        if idx[0].numel() == 0:
            break
        cand = (step[idx].view(torch.int16) + nudge).view(torch.float16).float()
        qc, ok = rebuild(blocks[idx], low[idx], cand)
        hit = tuple(i[ok] for i in idx)
        q[hit] = qc[ok]
        d[hit] = cand[ok].clamp(min=0.0)
        left[hit] = False
    if bool(left.any()):
        return None
    packed = (q[..., :16] | (q[..., 16:] << 4)).contiguous()
    return packed, torch.stack([d, low], dim=-1).contiguous()


def _q4_packed(parts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """An int4 layer matrix (the rows of ``parts`` stacked): its exact 4-bit blocks (``_q4_blocks``)
    in the kernel's ``q4_pack`` layout, uint8. Raises ConfigError (a ValueError) where the matrix is
    not made of them (int4 is the Q4_1 GGUF's own weights, not a new rounding) or the kernel cannot
    take them."""
    from verispec.config import ConfigError  # a ValueError the CLI prints as one line

    kernel = _load_kernel()
    if kernel is None or not kernel.vnni_tiles_ready():
        raise ConfigError(
            "int4 and w4a8 weights run on the C++ kernel with AVX-512 VNNI, which this machine lacks"
        )
    w = torch.cat([t.detach().float() for t in parts], dim=0)
    blocks = _q4_blocks(w) if w.shape[0] % 16 == 0 else None
    if blocks is None:
        raise ConfigError(
            f"int4 and w4a8 need every layer matrix made of exact Q4_1 blocks (a Q4_1 GGUF, such as the "
            f"default model); {what} is not"
        )
    return kernel.q4_pack(*blocks)


def _q8_packed(head: torch.Tensor) -> torch.Tensor | None:
    """int4's output head ``[V, H]`` as exact 8-bit blocks (``_q8_blocks``) in the kernel's
    ``q8_pack`` layout, uint8, or None where it is not made of them (it then stays int8 per row)."""
    w = head.detach().float()
    blocks = _q8_blocks(w) if w.shape[0] % 16 == 0 else None
    return None if blocks is None else _load_kernel().q8_pack(*blocks)


def _q8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The exact 8-bit blocks of a float32 matrix, or None where it has none.

    GGUF's Q8_0 stores each block of 32 weights as ``d * q`` with ``q`` in -127..127 and ``d``
    float16, exact in float32 once transformers dequantises it; the block's largest magnitude is
    ``127 d``, so ``d`` is that over 127. A block counts only if ``d * q`` gives every weight back
    bitwise, and the matrix only if every block does (SmolLM2's embedding, its output head).

    Args:
        w: ``[N, K]`` float32, ``K % 32 == 0`` and ``N`` even (else None).

    Returns:
        ``q`` ``[N, K / 32, 32]`` int8 and ``d`` ``[N, K / 32]`` float32.
    """
    n, k = w.shape
    if w.dtype != torch.float32 or k % 32 or n % 2 or not bool(torch.isfinite(w).all()):
        return None
    blocks = w.reshape(n, k // 32, 32)
    d = (blocks.abs().amax(dim=-1) / 127).half().float()  # [N, K / 32]
    q = (blocks / torch.where(d > 0, d, 1.0)[..., None]).round_().clamp_(-128, 127)
    q = (q * (d > 0)[..., None]).to(torch.int8)  # the codes as the kernel holds them
    if not bool(_same_bits(d[..., None] * q.float(), blocks).all()):
        return None
    return q.contiguous(), d.contiguous()


def _group_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Blocks laid out as the kernel reads them (its ``Grouped``): rows in groups of 8 (the last may
    hold fewer), and for each group and block, the group's codes then its scales, so that a pass
    over 8 weight rows reads one stream from memory.

    Args:
        codes: ``[N, B, c]`` one byte each (``_q4_blocks``' uint8 or ``_q8_blocks``' int8).
        scales: ``[N, B, s]`` or ``[N, B]`` float32.

    Returns:
        ``[N * B * (c + 4 s)]`` uint8.
    """
    n, nb = codes.shape[:2]
    c = codes.contiguous().view(torch.uint8).reshape(n, nb, -1)
    sc = scales.reshape(n, nb, -1).contiguous().view(torch.uint8)  # [N, B, 4 s]

    def groups(rows: slice, size: int) -> torch.Tensor:  # [G, B, size * (c + 4 s)] for groups of size
        def lay(t: torch.Tensor) -> torch.Tensor:
            part = t[rows]
            width = part.shape[-1]
            return part.reshape(-1, size, nb, width).transpose(1, 2).reshape(-1, nb, size * width)

        return torch.cat([lay(c), lay(sc)], dim=2)

    full = n - n % 8
    parts = [groups(slice(0, full), 8).reshape(-1)]
    if n % 8:
        parts.append(groups(slice(full, n), n % 8).reshape(-1))
    return torch.cat(parts)


class FastLlama:
    """Llama-family causal LM with a static per-row KV cache; implements ``KVModel``."""

    kernel_max_tokens: int = 16
    """Calls feeding at most this many tokens per row take the kernel path (bitwise T-independent)."""
    prefill_chunk: int = 2048
    """Longer torch-path calls are split into chunks of this many tokens to bound activations
    (2048 tokens: about 25 MB in the widest one). A prompt in one chunk gets the causal attention
    that skips the masked half; later chunks need an explicit mask."""
    kernel_prefill_piece: int = 128
    """Longer calls that still run on the kernel (up to ``kernel_prefill_max``) go in pieces of this
    many tokens per row. Each piece reads every weight once, so pieces of ``kernel_max_tokens`` (16)
    left a float32 prompt bound by memory. Measured on the Xeon (session 17, SmolLM2-135M, min of 4,
    ms, pieces of 16 / 64, torch path beside): float32 64 tokens 138 / 99 (234), 128 321 / 188
    (323), 192 505 / 404 (466), 256 - / 474 (535), 384 - / 750 (761); int8 64 98 / 90 (111), 128
    191 / 172 (161); there 128 tokens in one piece took 197. On the 2-core Zen 5 EPYC, once its
    float32 passes were tiled for the arithmetic (session 25, ``/tmp/s25/piece.py``, min of 6 in
    one process, ms, pieces of 64 / 128 / 256): float32 256 tokens 196 / 177 / 182 and 700 tokens
    586 / 536 / 536 (a second run: 536 / 509 / 493); int8 unchanged (700 tokens 422 / 423 / 421).
    The kernel's logits do not depend on how many tokens share a call, so they are bitwise the
    same."""
    kernel_prefill_max: dict[str, int] = {
        "float32": 96,
        "bfloat16": 96,
        "int8": 96,
        **dict.fromkeys(KERNEL_ONLY_DTYPES, schedule.EVERY_PROMPT),
    }
    """Calls up to this many tokens per row (by weight format) still run on the kernel, in pieces of
    ``kernel_prefill_piece``: below it the torch path's fixed costs (widening bfloat16/int8 weights to a
    float32 copy, small-GEMM overheads) exceed the kernel's. These defaults are the 2-core EPYC's
    (session 4, min of 3, kernel against torch, ms): float32 48 tokens 105 / 140, 64 201 / 200, 96
    250 / 272, 128 348 / 326, 256 676 / 548; int8 96 255 / 386, 128 354 / 344; bfloat16 96 253 /
    315, 128 335 / 358. Models of real size replace the one for their format per instance with the
    crossing measured once per machine (:func:`verispec.models.schedule.apply_prefill`)."""
    screen_head: bool = os.environ.get("VERISPEC_NO_HEAD_SCREEN", "") in ("", "0")
    """Whether ``from_hf`` gives a float32 model on the kernel a greedy screen of its head
    (``_head_screen``; 28 MB more for SmolLM2-135M's 113 MB head): calls whose caller reads only the
    argmax (``logits="argmax"``) then read the head's int8 codes and the float32 rows of a few
    candidates instead of the whole float32 head, and return that head's own logits, bitwise, where
    the maximum could lie (-inf elsewhere). ``VERISPEC_NO_HEAD_SCREEN=1`` turns it off."""
    q4_weights: bool = os.environ.get("VERISPEC_NO_Q4", "") in ("", "0")
    """Whether ``from_hf`` gives a float32 model on the kernel the exact 4-bit blocks of its layer
    matrices where they have them (``_q4_blocks``: every layer matrix of a Q4_1 GGUF model, such as
    the default one). Calls of up to ``q4_rows`` tokens then read 6 bits per weight instead of 32,
    with bitwise the same outputs. ``VERISPEC_NO_Q4=1`` turns it off."""
    q4_rows: int = 6
    """Calls of up to this many tokens read the 4-bit blocks; wider ones, whose arithmetic outweighs
    the reading, the float32 matrices (the outputs are the same). Measured on the 2-core EPYC (Zen 4,
    256-bit tiles; all 120 layer matrices of SmolLM2-135M, min of 9 interleaved rounds, ms, float32 /
    blocks): 1 token 13.3 / 5.8, 2 15.0 / 6.8, 5 14.8 / 9.6, 9 14.7 / 17.9. The default for small
    models; a model of real size with blocks sets both this and ``head_q8_rows`` per instance to the
    crossing measured once per machine (:func:`verispec.models.schedule.apply_blocks`: 8 tokens on a
    Zen 5 EPYC with 512-bit tiles)."""
    head_q8_rows: int = 6
    """Calls wanting the whole head's logits (sampling; greedy ones without the screen, or whose
    screen could not decide) for up to this many rows read its exact 8-bit blocks where it has them
    (``_q8_blocks``: a GGUF model's Q8_0 embedding, SmolLM2's head) instead of the float32 head,
    with bitwise the same logits; found under ``q4_weights`` like the layers' blocks. Measured on
    the 2-core EPYC (SmolLM2-135M at 200 cached tokens, whole-head logits, min of 15 interleaved
    calls, ms, blocks / float32): 1 token 8.5 / 15.5, 5 13.8-14.6 / 17.4, 9 19.6-19.9 / 17.6 (the
    layers read float32 rows at 9 either way). Greedy calls keep the screen, which beat the blocks:
    1 token 6.9 against 8.5 ms."""
    pair_weights: bool = True
    """Whether ``from_hf`` hands the kernel its matrices (layers, embedding, head) pair-interleaved
    (``_interleave_pairs``): one stream per pair of weight rows, which one core reads near its full
    bandwidth (float32 one-token forward, layers only: 19.2-21.0 -> 17.2-18.8 ms at the machine's
    usual bandwidth, 16.4-19.2 -> 12.3-14.7 ms when it has more to give; int8 5.8-8.3 -> 5.1-6.7).
    The outputs are bitwise the same; long prefills on the torch path pay a row-major copy of each
    matrix per call (the kernel's ``rows_from_pairs``, :func:`_rows_for`), and gather embedding rows
    from the pairs."""

    def __init__(
        self,
        config: Any,
        weights: dict[str, Any],
        *,
        tokenizer: object | None,
        dtype: str,
        max_batch_size: int,
        max_length: int,
        use_kernel: bool,
    ) -> None:
        """Use ``from_hf``; ``weights`` is the repacked dict that it builds."""
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_length = max_length
        self.vocab_size: int = config.vocab_size
        self.device: torch.device = weights["norm"].device
        self._w = weights
        self._eps = float(config.rms_norm_eps)
        self._n_layers = len(weights["layers"])
        self._n_heads = config.num_attention_heads
        self._n_kv = config.num_key_value_heads
        self._head_dim = weights["cos"].shape[1]
        self._capacity = 0
        self._batch = 0
        self._lengths = np.zeros(0, dtype=np.int64)
        """Tokens held per slot, in numpy: each decoding step reads and writes it, and a dozen small
        torch operations per step cost 0.2-0.4 ms here, most of it cache misses, since the forward
        before them has streamed the weights through every cache level."""
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self._kernel: Any = None
        self.amx_rows = schedule.AMX_ROWS
        """From how many tokens a call reads the int8 matrices' AMX tiles where the kernel has them
        (:func:`verispec.models.schedule.apply_amx`: prompts, not decoding steps; outputs the same)."""
        if use_kernel:
            self._kernel = self._build_kernel()
        self.kv_dtype: torch.dtype = _kv_dtype(dtype, self._kernel is not None, self._head_dim)
        """Dtype of the KV cache (:func:`_kv_dtype`): float16 for the int8, bfloat16, int4 and w4a8
        formats on the kernel (bfloat16 for int4 and w4a8 with ``VERISPEC_KV_CACHE=bfloat16``),
        float32 otherwise."""
        self.prefill_compute: torch.dtype | None = (
            torch.bfloat16 if dtype != "float32" and _native_bfloat16(self.device) else None
        )
        """Dtype of the matrix products and attention of long prefills (calls of more than
        ``kernel_prefill_max`` tokens per row, with or without the kernel): bfloat16 for the
        bfloat16 and int8 formats where the hardware runs it natively, None (float32) otherwise.
        Prefill is compute-bound, and bfloat16 products run about 2.3x float32's rate on the 2-core
        EPYC, 3-6x on the Xeon with AMX (SDPA over 700 tokens: 8.7 -> 3.3 ms a layer); float32 weights
        keep float32 products (exact w.r.t. HF). Plain and speculative decoding share the
        prefill, so their outputs stay identical."""
        self._row_buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
        """The torch path's row-major copies of one layer's paired matrices (``_rows_for``), reused
        by every layer and call: one buffer per shape and dtype (SmolLM2-135M: 14 MB in float32)."""
        self._threads = ThreadTuner()
        """Picks 1 or all threads per kernel call from measured times (see ``threads.py``)."""
        self._record_hidden = False
        self.last_hidden: torch.Tensor | None = None
        """With ``record_hidden``: the last forward's final residual stream (before the final norm),
        ``[n, T, hidden]`` float32, one line per row it was given, in order."""
        self.hidden_by_row: dict[int, tuple[int, torch.Tensor]] = {}
        """With ``record_hidden``: for each row, ``(start, hidden [T, hidden])`` of the last forward
        that fed it (positions ``start .. start + T - 1``); survives calls on other rows."""
        self.reset(max_batch_size)
        self.kernel_schedule: str | None = None
        """How the kernel reads the paired weights on this machine (:mod:`verispec.models.schedule`;
        measured once per machine, outputs the same either way); None without the kernel."""
        self.step_cost_prior: list[float] | None = None
        """``[v(1), ..., v(W)]``: a greedy step of each width over a one-token step, measured once per
        machine (:func:`verispec.models.schedule.apply_step_costs`), the engine's prior for pricing
        drafts (:func:`verispec.costs.costs_for`); None without the kernel or for small models."""
        if self._kernel is not None:
            self.kernel_schedule = schedule.apply(self)
            schedule.apply_amx(self)
            schedule.apply_prefill(self)
            schedule.apply_blocks(self)
            schedule.apply_step_costs(self)

    @property
    def record_hidden(self) -> bool:
        """Whether each forward keeps its tokens' last hidden states in ``last_hidden``.

        Drafters that read the target's features (EAGLE-style heads) turn this on.
        """
        return self._record_hidden

    @record_hidden.setter
    def record_hidden(self, on: bool) -> None:
        self._record_hidden = bool(on)
        self.last_hidden = None
        self.hidden_by_row = {}
        if self._kernel is not None:
            self._kernel.set_keep_hidden(self._record_hidden)

    # ----------------------------------------------------------------------------------- loading

    @staticmethod
    def supports(hf_model: Any) -> bool:
        """True when ``hf_model`` is a Llama-style decoder this class reproduces exactly."""
        config = getattr(hf_model, "config", None)
        if config is None or getattr(config, "model_type", None) not in _SUPPORTED_TYPES:
            return False
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
            return False
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") not in _STATIC_ROPE:
            return False
        inner = getattr(hf_model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
            return False
        head_dim = _head_dim(config)
        return head_dim % 2 == 0 and config.num_attention_heads % config.num_key_value_heads == 0

    @classmethod
    def from_hf(
        cls,
        hf_model: Any,
        tokenizer: object | None = None,
        dtype: str = "float32",
        max_batch_size: int = 1,
        max_length: int | None = None,
        use_kernel: bool | None = None,
    ) -> FastLlama:
        """Repack a loaded HF ``LlamaForCausalLM``/``MistralForCausalLM``/``Qwen2ForCausalLM``.

        Args:
            hf_model: the loaded model (any weight source: safetensors, GGUF-dequantised, ...).
            tokenizer: kept as ``self.tokenizer``.
            dtype: "float32" (exact w.r.t. the HF model), "bfloat16" (weight matrices rounded to
                bf16 and widened in the kernel: half the memory traffic) or "int8" (symmetric int8
                with one float32 scale per weight row: a quarter of the traffic) or "int4" (a Q4_1
                model's own layer blocks, exact, multiplied in integers by int16 activations on the
                kernel only; the embedding and head its Q8_0 blocks where it has them, else int8;
                ValueError for other models) or "w4a8" (int4's weights, the activations of its
                products rounded to 8 bits per block of 32: half the integer work). Norms, biases
                and the rest of the arithmetic stay float32 in every format; the KV cache is
                float16 for all but float32 on the kernel, float32 otherwise (``_kv_dtype``).
            max_batch_size: rows to preallocate caches for (``reset`` can grow them).
            max_length: context cap; defaults to ``config.max_position_embeddings``.
            use_kernel: None = use the C++ kernel when it builds (and ``VERISPEC_NO_KERNEL`` is unset);
                False forces the torch path.
        """
        if not cls.supports(hf_model):
            raise ValueError(f"FastLlama does not support {type(hf_model).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
        if use_kernel is None:
            use_kernel = not _kernel_turned_off()
        if dtype in KERNEL_ONLY_DTYPES and not use_kernel:
            from verispec.config import ConfigError

            raise ConfigError(f"{dtype} weights run on the C++ kernel only; it is turned off here")
        config = hf_model.config
        limit = int(config.max_position_embeddings)
        if _uses_sliding_window(config):
            # Below the window, sliding-window attention is plain causal attention; capping the
            # context keeps us exact without a windowed mask.
            limit = min(limit, int(config.sliding_window))
        max_length = limit if max_length is None else min(int(max_length), limit)
        weights = _repack(hf_model, dtype, max_length)
        device = weights["norm"].device
        use_kernel = bool(use_kernel) and device.type == "cpu" and _load_kernel() is not None
        if use_kernel and cls.screen_head and dtype == "float32":
            weights["head_screen"] = _head_screen(weights["head"])
        if use_kernel and cls.q4_weights and dtype == "float32":
            for layer in weights["layers"]:
                for key in _LAYER_MATRICES:
                    blocks = _q4_blocks(layer[key])
                    if blocks is not None:
                        layer[key + "_q4"] = _group_blocks(*blocks)
            head_blocks = _q8_blocks(weights["head"])
            if head_blocks is not None:
                weights["head_q8"] = _group_blocks(*head_blocks)
        if device.type == "cpu":
            _onto_huge_pages(weights)
        if use_kernel and cls.pair_weights:
            mats = [(layer, key) for layer in weights["layers"] for key in _LAYER_MATRICES]
            mats.append((weights, "embed"))
            if weights["head"] is not weights["embed"]:  # tied: the embedding (or both None)
                mats.append((weights, "head"))
            if "head_screen" in weights:
                mats.append((weights["head_screen"], "codes"))
            for d, key in mats:
                if d[key] is not None and _pairs_ok(d[key]):
                    _interleave_pairs(d[key])
            weights["paired"] = True
        return cls(
            config,
            weights,
            tokenizer=tokenizer,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_length=max_length,
            use_kernel=use_kernel,
        )

    def _build_kernel(self) -> Any:
        """Hand the (shared, not copied) weight tensors to a C++ ``FastLlamaKernel``."""
        w = self._w
        k = _load_kernel().FastLlamaKernel(
            self.config.hidden_size,
            self._n_heads,
            self._n_kv,
            self._head_dim,
            self.config.intermediate_size,
            self._eps,
        )
        k.set_paired(bool(w.get("paired")))
        for lw in w["layers"]:
            if self.kernel_only:
                k.add_layer_q4(
                    lw["in_norm"], lw["wqkv_q4i"], lw["bqkv"], lw["wo_q4i"], lw["bo"],
                    lw["post_norm"], lw["wgu_q4i"], lw["wdown_q4i"],
                )  # fmt: skip
                continue
            k.add_layer(
                lw["in_norm"], lw["wqkv"], lw["bqkv"], lw["wo"], lw["bo"],
                lw["post_norm"], lw["wgu"], lw["wdown"],
                lw["wqkv_scale"], lw["wo_scale"], lw["wgu_scale"], lw["wdown_scale"],
            )  # fmt: skip
        for i, lw in enumerate(w["layers"]):
            for which, key in enumerate(_LAYER_MATRICES):
                if lw.get(key + "_q4") is not None:
                    k.set_q4(i, which, lw[key + "_q4"])
        if w["head"] is None:  # int4, w4a8: the head and embedding as their 8-bit blocks only
            k.set_head_blocks(w.get("embed_q8i"), w["norm"], w["head_q8i"])
        else:
            k.set_head(w["embed"], w["norm"], w["head"], w["embed_scale"], w["head_scale"])
            if w.get("head_q8i") is not None or w.get("embed_q8i") is not None:
                k.set_q8i(w.get("head_q8i"), w.get("embed_q8i"))
        if w.get("head_q8") is not None:
            k.set_head_q8(w["head_q8"])
        k.set_act8(self.dtype == "w4a8")
        k.set_block_rows(self.q4_rows, self.head_q8_rows)
        if "head_screen" in w:
            sc = w["head_screen"]
            k.set_head_screen(sc["codes"], sc["scale"], sc["wnorm"], sc["resid"])
        k.set_rope(w["cos"], w["sin"])
        amx = self.dtype == "int8" and amx_enabled()
        if amx or (self.dtype == "int8" and vnni_tiles_enabled()):
            head = amx  # the VNNI tiles serve prompts, whose head rows are one per request
            k.pack_tiles(huge_page_bytes(int(k.tile_bytes_needed(head=head))), head=head)  # None: own memory
            if amx:
                k.set_amx(True)
            else:
                k.set_vnni_tiles(True)
            k.set_amx_rows(self.amx_rows)
        return k

    @property
    def kernel_only(self) -> bool:
        """Whether every call must run on the kernel (``KERNEL_ONLY_DTYPES``): its prompts are never
        handed to the torch path (``kernel_prefill_max`` unbounded), nor are wide trees of drafts."""
        return self.dtype in KERNEL_ONLY_DTYPES

    @property
    def uses_kernel(self) -> bool:
        """Whether short calls run on the C++ kernel (False: torch fallback everywhere)."""
        return self._kernel is not None

    # ------------------------------------------------------------------------------ KVModel API

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens held per row, ``[batch_size]`` int64 on the CPU (a copy)."""
        return torch.from_numpy(self._lengths[: self._batch].copy())

    def reset(self, batch_size: int) -> None:
        """Empty every row; grows the ``[B, H_kv, S, D]`` caches when ``batch_size`` exceeds them.

        Old cache contents are not cleared: every position past a row's length is masked.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if batch_size > self._capacity:
            # A bfloat16 cache's layouts (the kernel's `bf16_key_at`) come in blocks of 32 positions.
            positions = -(-self.max_length // 32) * 32 if self.kv_dtype == torch.bfloat16 else self.max_length
            shape = (batch_size, self._n_kv, positions, self._head_dim)
            # Zeros, not empty: the torch path reads (masked) positions past a row's length, and
            # uninitialised NaNs would leak through softmax weights of exactly 0.
            self.k_cache = [
                torch.zeros(shape, device=self.device, dtype=self.kv_dtype) for _ in range(self._n_layers)
            ]  # fmt: skip
            self.v_cache = [
                torch.zeros(shape, device=self.device, dtype=self.kv_dtype) for _ in range(self._n_layers)
            ]  # fmt: skip
            self._capacity = batch_size
            if self._kernel is not None:
                self._kernel.set_cache(self.k_cache, self.v_cache)
        self._batch = batch_size
        self._lengths = np.zeros(self._capacity, dtype=np.int64)

    def weight_bytes(self) -> int:
        """Bytes of the weights held (a tied head counts once; RoPE tables excluded; the head's
        greedy screen and the kernel's AMX tile copies of int8 matrices included)."""
        tiles = getattr(self._kernel, "tile_bytes", None)
        return self._tensor_weight_bytes() + (int(tiles()) if tiles is not None else 0)

    def _tensor_weight_bytes(self) -> int:
        """Bytes of the weight tensors this object holds (not the kernel's tile copies)."""
        return tensor_bytes({k: v for k, v in self._w.items() if k not in ("cos", "sin")})

    def read_bytes(self, greedy: bool = False, blocks: bool = True) -> int:
        """Bytes of the weights a one-token decode step reads: all of them but the head's screen,
        or with ``greedy`` and a screen (``screen_head``), all but the float32 head (a tied one is
        the embedding, of which a step reads one row); of a layer matrix with 4-bit blocks
        (``q4_weights``), the blocks and not its float32 copy, and of a head with 8-bit blocks
        (``head_q8_rows``) read whole, the blocks. With ``blocks=False``: what the step would read
        without any blocks (the float32 matrices and head instead). With AMX tiles of the int8
        matrices, the step reads the tiles instead of the matrices, the same bytes."""
        w = self._w
        unread: list[torch.Tensor] = []
        for layer in w["layers"]:
            for key in _LAYER_MATRICES:
                if layer.get(key + "_q4") is not None:
                    unread.append(layer[key] if blocks and self.q4_rows > 0 else layer[key + "_q4"])
        # int4, w4a8 read the head's 8-bit blocks, not int8 rows beside them (None where there are
        # none: tensor_bytes counts nothing for it), and an untied embedding's rows from its blocks
        if w.get("head_q8i") is not None:
            unread.append(w["head"])
        if w.get("embed_q8i") is not None:
            unread.append(w["embed"])
        head_q8 = [w["head_q8"]] if w.get("head_q8") is not None else []
        screen = w.get("head_screen")
        if greedy and screen is not None:  # the screen and a few rows of the head
            unread += [w["head"], *head_q8]
        else:
            unread += list(screen.values()) if screen is not None else []
            unread += [w["head"]] if head_q8 and blocks and self.head_q8_rows > 0 else head_q8
        return self._tensor_weight_bytes() - tensor_bytes(unread)

    @property
    def has_blocks(self) -> bool:
        """Whether some weight is also held as its exact blocks (``q4_weights``)."""
        w = self._w
        return w.get("head_q8") is not None or any(
            layer.get(key + "_q4") is not None for layer in w["layers"] for key in _LAYER_MATRICES
        )

    def screen_counts(self) -> tuple[int, int]:
        """``(rows, whole)``: rows of logits screened so far, and how many of them took the whole
        head (too many candidates); ``(0, 0)`` without a screen."""
        return tuple(self._kernel.screen_counts()) if self._kernel is not None else (0, 0)

    def cache_bytes(self) -> int:
        """Bytes of the preallocated key/value caches (all slots, the whole context)."""
        return tensor_bytes(self.k_cache) + tensor_bytes(self.v_cache) if self._capacity else 0

    def truncate(self, lengths: torch.Tensor | Sequence[int], rows: list[int] | None = None) -> None:
        """Roll back: row ``rows[i]`` keeps its first ``lengths[i]`` tokens (``[n]`` int64, or ints)."""
        if isinstance(rows, list) and isinstance(lengths, list):  # every step's case: Python ints
            self._check_rows(rows)
            if len(lengths) != len(rows):
                raise ValueError(f"{len(lengths)} lengths for {len(rows)} rows")
            held = self._lengths
            if any(not 0 <= n <= held[r] for r, n in zip(rows, lengths)):
                raise ValueError("truncate can only shorten rows")
            for r, n in zip(rows, lengths):
                held[r] = n
            return
        idx = self._row_array(rows)
        new = np.asarray(lengths, dtype=np.int64).reshape(-1)  # a CPU tensor's memory, no copy
        if new.size != idx.size:
            raise ValueError(f"{new.size} lengths for {idx.size} rows")
        if (new < 0).any() or (new > self._lengths[idx]).any():
            raise ValueError("truncate can only shorten rows")
        self._lengths[idx] = new

    supports_tree = True
    """``forward`` takes ``offsets``: it can verify a tree of drafts in one call."""

    def forward(
        self,
        input_ids: torch.Tensor,
        rows: list[int] | None = None,
        logits: LogitsMode = "all",
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Append ``input_ids`` ``[n, T]`` to ``rows`` and return logits (see ``KVModel.forward``).

        ``offsets`` (``[n, T]`` int64, each ``offsets[i, t]`` in ``[0, t]``) verifies a tree of
        drafts: token t of row i is still written to cache position ``starts[i] + t``, but it sees
        only the positions before ``starts[i] + offsets[i, t]`` and itself, at RoPE position
        ``starts[i] + offsets[i, t]``; its logits are those it would have at that position of a
        chain. None is the causal chain (``offsets[i, t] = t``). After a tree call,
        :meth:`keep_path` moves the accepted tokens into place.

        Returns ``[n, T, V]`` for "all" and "argmax", ``[n, V]`` for "last", None for "none";
        float32. "argmax" calls on the kernel with a head screen (``screen_head``) hold the head's
        own logits only where each position's maximum could lie, -inf elsewhere.
        """
        if logits not in ("all", "argmax", "last", "none"):
            raise ValueError(f"logits must be 'all', 'argmax', 'last' or 'none', not {logits!r}")
        rows_np = self._row_array(rows)  # [n]
        ids = torch.as_tensor(input_ids)
        if ids.dtype != torch.int64:
            ids = ids.to(dtype=torch.int64)
        if ids.dim() != 2 or ids.shape[0] != rows_np.size:
            raise ValueError(f"input_ids must be [{rows_np.size}, T], got {tuple(ids.shape)}")
        n, T = ids.shape
        starts_np = self._lengths[rows_np]  # [n], a copy
        if T == 0:
            return None if logits == "none" else self._empty_logits(n, logits)
        if int(starts_np.max()) + T > self.max_length:
            raise ValueError(f"a row would exceed max_length={self.max_length}")
        idx, starts = torch.from_numpy(rows_np), torch.from_numpy(starts_np)
        if offsets is not None:
            offsets = torch.as_tensor(offsets, dtype=torch.int64)
            if offsets.shape != ids.shape:
                raise ValueError(f"offsets must be {tuple(ids.shape)}, got {tuple(offsets.shape)}")
            if bool(((offsets < 0) | (offsets > torch.arange(T))).any()):
                raise ValueError("offsets[i, t] must lie in [0, t]")
            if self._kernel is not None and (T <= self.kernel_max_tokens or self.kernel_only):
                out = self._forward_kernel(ids, idx, starts, logits, offsets)
            else:
                tree = functools.partial(self._forward_torch, offsets=offsets)
                out = self._threads.follow(lambda: tree(ids, idx, starts, logits))
        elif self._kernel is not None and T <= self.kernel_max_tokens:
            out = self._forward_kernel(ids, idx, starts, logits)
        elif self._kernel is not None and T <= self.kernel_prefill_max.get(self.dtype, 0):
            out = self._in_pieces(self._forward_kernel, self.kernel_prefill_piece, ids, idx, starts, logits)
        else:
            compute = self.prefill_compute if T > self.kernel_prefill_max.get(self.dtype, 0) else None
            torch_path = functools.partial(self._forward_torch, compute=compute)
            out = self._threads.follow(
                lambda: self._in_pieces(torch_path, self.prefill_chunk, ids, idx, starts, logits)
            )
        if self._record_hidden and self.last_hidden is not None:
            for i, (row, start) in enumerate(zip(idx.tolist(), starts.tolist())):
                self.hidden_by_row[row] = (start, self.last_hidden[i])
        self._lengths[rows_np] = starts_np + T
        return out

    __call__ = forward

    def forward_greedy(self, lines: list[list[int]], rows: list[int]) -> list[list[int]]:
        """Append ``lines`` (``[n][T]`` token ids, one line per row in ``rows``) and return the index
        of the largest logit at every position, ``[n][T]`` (the first on ties, NaN counting as
        largest): ``forward(..., logits="argmax")`` and numpy's argmax over it, with the same
        results. On the kernel it is one call on Python ints (``forward_argmax``), without the
        tensors around a ``forward`` call: after a forward has streamed the weights through every
        cache level each small torch or numpy operation costs 10-100 us, and those of a one-token
        step (positions, slots, the ``[n, T, V]`` logits, their argmax, the truncation's arrays)
        took about 0.5 ms of an 8-10 ms int8 step on a 2-core Zen 3 EPYC."""
        n = len(rows)
        T = len(lines[0]) if lines else 0
        if (
            self._kernel is None
            or self._record_hidden
            or n == 0
            or not 0 < T <= self.kernel_max_tokens
            or len(lines) != n
            or any(len(line) != T for line in lines)
        ):
            return forward_argmax(self, lines, rows)
        self._check_rows(rows)
        starts = [int(self._lengths[r]) for r in rows]
        if max(starts) + T > self.max_length:
            raise ValueError(f"a row would exceed max_length={self.max_length}")
        ids = [t for line in lines for t in line]
        slots = [r for r in rows for _ in range(T)]
        pos = [s + t for s in starts for t in range(T)]
        best = self._threads.run(lambda: self._kernel.forward_argmax(ids, slots, pos), tokens=n * T)
        for r, s in zip(rows, starts):
            self._lengths[r] = s + T
        return [best[i * T : (i + 1) * T] for i in range(n)]

    def keep_path(self, row: int, start: int, picks: list[int]) -> None:
        """After a tree forward on ``row`` that began at cache position ``start``: the tokens it fed
        at offsets ``picks`` (increasing, each >= its index) become positions ``start``,
        ``start + 1``, ...: their keys and values move there, and so do their recorded hidden
        states. The row's length is left alone (``truncate`` follows)."""
        moved = [i for i, p in enumerate(picks) if p != i]
        if moved:
            dst = torch.tensor([start + i for i in moved])
            src = torch.tensor([start + picks[i] for i in moved])
            if self._kernel is not None:  # one call instead of two indexing ops per layer
                self._kernel.move_positions(row, src, dst)
            else:
                dst, src = dst.to(self.device), src.to(self.device)
                for cache in (*self.k_cache, *self.v_cache):
                    cache[row, :, dst] = cache[row, :, src]  # [H_kv, m, D]; the source is read first
        if self._record_hidden and row in self.hidden_by_row:
            first, hidden = self.hidden_by_row[row]
            take = torch.tensor([start - first + p for p in picks])
            self.hidden_by_row[row] = (start, hidden[take])

    # ---------------------------------------------------------------------------------- internals

    def _check_rows(self, rows: list[int]) -> None:
        """Raise unless ``rows`` are distinct rows of the batch (on Python ints)."""
        if not all(0 <= r < self._batch for r in rows):
            raise ValueError(f"rows {rows} out of range for batch size {self._batch}")
        if len(rows) > 1 and len(set(rows)) != len(rows):
            raise ValueError(f"rows {rows} contain duplicates")

    def _row_array(self, rows: list[int] | None) -> np.ndarray:
        """Validated row indices ``[n]`` int64 (all rows when None), as numpy (see ``_lengths``)."""
        if rows is None:
            return np.arange(self._batch, dtype=np.int64)
        if isinstance(rows, list):  # every step's case, checked on Python ints
            self._check_rows(rows)
            return np.array(rows, dtype=np.int64)
        idx = np.asarray(rows, dtype=np.int64).reshape(-1)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self._batch):
            raise ValueError(f"rows {rows} out of range for batch size {self._batch}")
        if idx.size > 1 and np.unique(idx).size != idx.size:
            raise ValueError(f"rows {rows} contain duplicates")
        return idx

    def _empty_logits(self, n: int, logits: LogitsMode) -> torch.Tensor:
        shape = (n, 0, self.vocab_size) if logits in ("all", "argmax") else (n, self.vocab_size)
        return torch.zeros(shape)

    def _forward_kernel(
        self,
        ids: torch.Tensor,
        idx: torch.Tensor,
        starts: torch.Tensor,
        logits: LogitsMode,
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One C++ call; token ``(i, t)`` is row ``idx[i]`` at position ``starts[i] + t`` (attending
        as at ``starts[i] + offsets[i, t]`` when ``offsets`` ``[n, T]`` is given, see ``forward``)."""
        n, T = ids.shape
        first = starts.numpy()[:, None]  # [n, 1]
        pos = torch.from_numpy((first + np.arange(T)).reshape(-1))  # [n*T]
        slots = torch.from_numpy(np.repeat(idx.numpy(), T))  # [n*T]
        wanted = logit_rows(n, T, logits)
        flat = ids.reshape(-1).contiguous()
        ctx = None if offsets is None else torch.from_numpy((first + offsets.numpy()).reshape(-1))  # [n*T]
        screen = logits == "argmax"
        out = self._threads.run(
            lambda: self._kernel.forward(flat, slots, pos, wanted, ctx, argmax_only=screen), tokens=n * T
        )
        if self._record_hidden:
            self.last_hidden = self._kernel.last_hidden().view(n, T, -1)
        if logits == "none":
            return None
        return out.view(n, T, -1) if logits in ("all", "argmax") else out

    def _in_pieces(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LogitsMode], torch.Tensor | None],
        size: int,
        ids: torch.Tensor,
        idx: torch.Tensor,
        starts: torch.Tensor,
        logits: LogitsMode,
    ) -> torch.Tensor | None:
        """``forward`` over ``ids`` ``[n, T]`` in pieces of ``size`` tokens (lengths are advanced by
        the caller); logits and recorded hidden states are concatenated over the pieces."""
        T = ids.shape[1]
        pieces, hidden = [], []
        for c0 in range(0, T, size):
            c1 = min(T, c0 + size)
            mode: LogitsMode = logits if (logits in ("all", "argmax") or c1 == T) else "none"
            out = forward(ids[:, c0:c1], idx, starts + c0, mode)
            if out is not None:
                pieces.append(out)
            if self._record_hidden:
                hidden.append(self.last_hidden)
        if self._record_hidden:
            self.last_hidden = hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=1)  # [n, T, hidden]
        if logits == "none":
            return None
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _forward_torch(
        self,
        ids: torch.Tensor,
        idx: torch.Tensor,
        starts: torch.Tensor,
        logits: LogitsMode,
        compute: torch.dtype | None = None,
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Matmul + SDPA forward of ``ids`` ``[n, T]`` at positions ``starts[i] + t``.

        ``compute``: the dtype of the matrix products (see ``_linear``) and of attention's inputs
        (SDPA accumulates in float32); None keeps float32. Norms, rotary embeddings and the SwiGLU
        activation compute in float32 either way, the residual stream and the KV cache stay in
        theirs. On the CPU with the kernel loaded, those three run as the kernel's fused ops
        (``rmsnorm_bf16`` or ``rmsnorm_f32``, ``rope_rows``, ``swiglu``): one pass each instead of
        eager torch's five to seven. With bfloat16 products their outputs are rounded to bfloat16
        once for the next product (a 769-token prompt, int8, 10 alternating rounds on the Xeon:
        median 985 -> 833 ms); with float32 products they stay float32 (session 39, the Xeon, five
        Spec-Bench prompts of 656-1334 tokens, median of 3: 653-1406 ms against 702-1519, about 7%
        less; the logits moved from bitwise HF's to within 2e-4 of them, as close as the kernel's
        own prompts of up to 500 tokens are).
        ``offsets`` ``[n, T]``: a tree of drafts (see ``forward``).
        With ``record_hidden``, keeps the final residual stream ``[n, T, hidden]`` in ``last_hidden``.
        """
        if self.kernel_only:
            raise RuntimeError(f"{self.dtype} weights run on the C++ kernel only")
        w = self._w
        n, T = ids.shape
        Hq, Hkv, D = self._n_heads, self._n_kv, self._head_dim
        dev = self.device
        # The kernel's fused element-wise ops (norms, rotary embeddings, SwiGLU) on the CPU, in
        # float32 as HF's model computes them, one pass each instead of eager torch's five to seven.
        fused = self._kernel is not None and dev.type == "cpu"
        kernel = _kernel_module if fused else None  # None: eager torch
        pos = (starts[:, None] + torch.arange(T)).to(dev)  # [n, T] cache positions
        rope = pos if offsets is None else (starts[:, None] + offsets).to(dev)  # [n, T]
        span = int(starts.max()) + T  # keys any query may see
        idx_d = idx.to(dev)
        # mask[i, 0, t, j]: query t of row i may attend to key position j. When every row starts
        # empty, that is the plain causal mask, which SDPA applies by skipping the masked half.
        keys_at = torch.arange(span, device=dev)[None, None, :]
        causal = span == T and offsets is None
        if offsets is not None:  # the positions before its own place in the chain, and itself
            mask = ((keys_at < rope[:, :, None]) | (keys_at == pos[:, :, None]))[:, None]
        else:
            mask = None if causal else (keys_at <= pos[:, :, None])[:, None]
        if kernel is None:
            cos = w["cos"][rope][:, :, None, :]  # [n, T, 1, D]
            sin = w["sin"][rope][:, :, None, :]
        contiguous = bool((idx == torch.arange(int(idx[0]), int(idx[0]) + n)).all())
        paired = bool(w.get("paired"))  # the kernel's layout: matrices are read as rows again
        x = _rows_at(w["embed"], ids.to(dev), paired).float()  # [n, T, hidden]
        if w["embed_scale"] is not None:
            x = x * w["embed_scale"][ids.to(dev)][..., None]  # int8 rows, dequantised as the kernel does
        for layer, kc, vc in zip(w["layers"], self.k_cache, self.v_cache, strict=True):
            if paired:  # a row-major copy of each matrix per call, into the buffers reused by all
                rows = {
                    m: _rows_for(layer[m], paired, compute, _kernel_module, self._row_buffers)
                    for m in _LAYER_MATRICES
                }
                layer = {**layer, **rows}
            h = _norm(x, layer["in_norm"], self._eps, kernel, compute)
            # [n, T, (Hq + 2 Hkv) D]
            qkv = _linear(h, layer["wqkv"], layer["bqkv"], layer["wqkv_scale"], compute)
            if kernel is not None:  # queries and keys rotated in place, in one pass
                kernel.rope_rows(qkv.view(n * T, -1), w["cos"], w["sin"], rope.reshape(-1), Hq + Hkv)
            q, k, v = qkv.view(n, T, Hq + 2 * Hkv, D).split([Hq, Hkv, Hkv], dim=2)
            if kernel is None:
                q = q * cos + _rotate_half(q) * sin  # [n, T, Hq, D]
                k = k * cos + _rotate_half(k) * sin  # [n, T, Hkv, D]
            kc[idx_d[:, None], :, pos] = k.to(kc.dtype)  # scatter into [B, Hkv, S, D] at (row, :, pos)
            vc[idx_d[:, None], :, pos] = v.to(vc.dtype)
            if contiguous:
                i0 = int(idx[0])
                keys, values = kc[i0 : i0 + n, :, :span], vc[i0 : i0 + n, :, :span]
            else:
                keys, values = kc[idx_d, :, :span], vc[idx_d, :, :span]  # [n, Hkv, span, D]
            if compute is not None:  # attention in the products' dtype, float32 accumulation
                q, keys, values = q.to(compute), keys.to(compute), values.to(compute)
            elif keys.dtype != q.dtype:  # a float16 cache, widened exactly
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys,
                values,
                attn_mask=mask,
                is_causal=causal,
                scale=D**-0.5,
                enable_gqa=True,
            )  # [n, Hq, T, D]
            att = att.transpose(1, 2).reshape(n, T, Hq * D)
            x = x + _linear(att, layer["wo"], layer["bo"], layer["wo_scale"], compute)
            h = _norm(x, layer["post_norm"], self._eps, kernel, compute)
            act = _swiglu_linear(h, layer["wgu"], layer["wgu_scale"], compute, kernel)  # [n, T, I]
            x = x + _linear(act, layer["wdown"], scale=layer["wdown_scale"], compute=compute)
        if self._record_hidden:
            self.last_hidden = x.float().cpu()  # [n, T, hidden]
        if logits == "none":
            return None
        if logits == "last":
            x = x[:, -1]  # [n, hidden]: only the last position pays for the vocab projection
        x = _rms_norm(x, w["norm"], self._eps)
        rows = x.shape[:-1]
        if self._kernel is not None and paired and rows.numel() <= self.kernel_max_tokens:
            # A few rows (a prompt's last position): the kernel reads the paired head once, where
            # the torch path would first copy it (113 MB in float32) into rows.
            flat = x.reshape(-1, x.shape[-1]).contiguous()  # [rows, hidden] float32
            out = self._kernel.linear(flat, w["head"], None, w["head_scale"], paired=_pairs_ok(w["head"]))
            return out.view(*rows, -1)
        head = _rows_for(w["head"], paired, compute, _kernel_module)  # not kept (113 MB in float32)
        out = _linear(x, head, scale=w["head_scale"], compute=compute).float()
        return out.cpu()  # sampling and acceptance run on the CPU (a no-op there)


def bf16_attention_ok(head_dim: int) -> bool:
    """Whether the kernel can hold a bfloat16 cache and attend over it (``attention_bf16``): a build
    with AVX-512 BF16 and head dimension 64."""
    kernel = _load_kernel()
    ready = getattr(kernel, "bf16_attention_ready", None)  # None: no kernel, or a build before it
    return head_dim == 64 and ready is not None and bool(ready())


def _kv_dtype(dtype: str, kernel: bool, head_dim: int = 64) -> torch.dtype:
    """The KV cache's dtype for weight format ``dtype``: float16 for "bfloat16", "int8", "int4" and
    "w4a8" on the kernel, float32 otherwise; ``VERISPEC_KV_CACHE=float32``, ``float16`` or
    ``bfloat16`` overrides.

    Decoding reads every cached key and value once per step: SmolLM2-135M at 1500 cached tokens
    reads 69 MB of float32 keys and values against 135 MB of int8 weights. float16 halves that,
    as llama.cpp's default cache does; keys and values widen exactly to float32 before any
    arithmetic. float32 weights keep a float32 cache (exact w.r.t. HF).

    ``bfloat16`` (int4 and w4a8 on a kernel with AVX-512 BF16, head dimension 64:
    :func:`bf16_attention_ok`; other formats keep their own cache) attends in bfloat16 products with
    float32 sums (the kernel's ``attention_bf16``), at twice float32's rate of multiply-adds, which
    bound a verification's attention. Queries, keys, values and the softmax's weights are rounded
    to bfloat16, so it costs accuracy: on SmolLM2-135M the top-1 agreement with float32 falls from
    97.1% to 96.1% for w4a8 (int8's level) and from 99.96% to 99.73% for int4. It is not the default.
    """
    choice = os.environ.get("VERISPEC_KV_CACHE", "")
    if choice not in ("", "float32", "float16", "bfloat16"):
        raise ValueError(f"VERISPEC_KV_CACHE must be float32, float16 or bfloat16, not {choice!r}")
    if choice in ("float32", "float16"):
        return torch.float16 if choice == "float16" else torch.float32
    if choice == "bfloat16" and kernel and dtype in KERNEL_ONLY_DTYPES:  # other formats: their own
        if not bf16_attention_ok(head_dim):
            raise ValueError(
                "VERISPEC_KV_CACHE=bfloat16 needs the kernel built with AVX-512 BF16 and head dimension 64"
            )
        return torch.bfloat16
    return torch.float16 if kernel and dtype in ("bfloat16", "int8", *KERNEL_ONLY_DTYPES) else torch.float32


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half: ``cat(-x2, x1)`` over the last dim of ``x`` ``[..., D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _uses_sliding_window(config: Any) -> bool:
    if getattr(config, "sliding_window", None) is None:
        return False
    if config.model_type == "qwen2":
        return "sliding_attention" in (getattr(config, "layer_types", None) or [])
    return True


def _repack(hf_model: Any, dtype: str, max_length: int) -> dict[str, Any]:
    """Fused, contiguous weight matrices in ``dtype`` (one of ``DTYPES``).

    Norms, biases and RoPE tables stay float32. Each matrix ``name`` comes with ``name + "_scale"``:
    its per-row scales ``[N]`` float32 for int8, None otherwise. int4 and w4a8 hold their layer
    matrices as ``name + "_q4i"`` blocks and, where the head and embedding are exact Q8_0 blocks,
    ``"head_q8i"`` (and ``"embed_q8i"`` untied) in place of ``"head"`` and ``"embed"``.
    """
    inner = hf_model.model

    def mat(*ts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        full = torch.cat([t.detach().float() for t in ts], dim=0)
        if dtype in ("int8", *KERNEL_ONLY_DTYPES):  # int4, w4a8: the embedding and head
            return _quantize_rows(full)
        return full.to(getattr(torch, dtype)).contiguous(), None

    def layer_mat(name: str, i: int, *ts: torch.Tensor) -> dict[str, Any]:
        """A layer matrix's entries: ``name`` and ``name + "_scale"``, or for int4 and w4a8 ``name``
        None and ``name + "_q4i"`` its exact 4-bit blocks in the kernel's layout (``_q4_packed``)."""
        if dtype not in KERNEL_ONLY_DTYPES:
            w, scale = mat(*ts)
            return {name: w, name + "_scale": scale}
        return {name: None, name + "_scale": None, name + "_q4i": _q4_packed(ts, f"layer {i}'s {name}")}

    def vec(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().float().contiguous()

    layers = []
    for i, blk in enumerate(inner.layers):
        att, mlp = blk.self_attn, blk.mlp
        bias = [p.bias for p in (att.q_proj, att.k_proj, att.v_proj)]
        layers.append(
            {
                "in_norm": vec(blk.input_layernorm.weight),
                **layer_mat("wqkv", i, att.q_proj.weight, att.k_proj.weight, att.v_proj.weight),
                "bqkv": None if bias[0] is None else torch.cat([vec(b) for b in bias]),
                **layer_mat("wo", i, att.o_proj.weight),
                "bo": vec(att.o_proj.bias),
                "post_norm": vec(blk.post_attention_layernorm.weight),
                **layer_mat("wgu", i, mlp.gate_proj.weight, mlp.up_proj.weight),
                **layer_mat("wdown", i, mlp.down_proj.weight),
            }
        )
    lm_head = hf_model.get_output_embeddings().weight
    tied = lm_head.data_ptr() == inner.embed_tokens.weight.data_ptr()
    # int4, w4a8: a head and an embedding made of exact Q8_0 blocks are kept as them (``q8_pack``;
    # a tied pair once), which the kernel reads instead of int8 rows. Where both are (SmolLM2's
    # tied pair), they are kept only as blocks ("embed" and "head" None); otherwise the int8 rows
    # stay beside whichever has blocks.
    blocks = dtype in KERNEL_ONLY_DTYPES
    head_q8i = _q8_packed(lm_head) if blocks else None
    embed_q8i = _q8_packed(inner.embed_tokens.weight) if blocks and not tied else None
    if head_q8i is not None and (tied or embed_q8i is not None):
        embed = embed_scale = head = head_scale = None
    else:
        embed, embed_scale = mat(inner.embed_tokens.weight)
        # A tied head is the embedding's tensors themselves (one copy, counted once by weight_bytes).
        head, head_scale = (embed, embed_scale) if tied else mat(lm_head)
    # Same arithmetic as HF's rotary embedding: float32 position * inv_freq, cos/sin, then the
    # attention scaling, so the tables are bitwise HF's.
    rot = inner.rotary_emb
    positions = torch.arange(max_length, dtype=torch.float32, device=rot.inv_freq.device)
    freqs = positions[:, None] * rot.inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
    return {
        "layers": layers,
        "embed": embed,
        "embed_scale": embed_scale,
        "head": head,
        "head_scale": head_scale,
        "head_q8i": head_q8i,
        "embed_q8i": embed_q8i,
        "norm": vec(inner.norm.weight),
        "cos": (emb.cos() * rot.attention_scaling).contiguous(),
        "sin": (emb.sin() * rot.attention_scaling).contiguous(),
    }


def _onto_huge_pages(weights: dict[str, Any]) -> None:
    """Move the weight matrices of ``weights`` (as ``_repack`` builds it) into one buffer backed by
    2 MB pages (``huge_page_bytes``), in place.

    Why: a decoding step streams every matrix once, 538 MB in float32, through 4 KB pages that the
    TLB cannot hold. Measured on the 2-core EPYC, interleaved rounds of 48 tokens: float32 21.4 ->
    20.3 ms per token (median of 10), int8 7.8 -> 7.3. Where huge pages are unavailable, the
    tensors stay as they are.
    """
    slots = [
        (layer, name)
        for layer in weights["layers"]
        for key in _LAYER_MATRICES
        for name in (key, key + "_q4", key + "_q4i")
        if layer.get(name) is not None
    ]
    if weights["embed"] is not None:  # None: int4's blocks only
        slots.append((weights, "embed"))
    for key in ("head_q8", "head_q8i", "embed_q8i"):
        if weights.get(key) is not None:
            slots.append((weights, key))
    tied = weights["head"] is weights["embed"]
    if not tied:
        slots.append((weights, "head"))
    if "head_screen" in weights:
        slots.append((weights["head_screen"], "codes"))
    sizes = [-(-d[k].numel() * d[k].element_size() // 64) * 64 for d, k in slots]
    raw = huge_page_bytes(sum(sizes))
    if raw is None:
        return
    start = 0
    for (d, k), size in zip(slots, sizes, strict=True):
        t = d[k]
        moved = raw[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        moved.copy_(t)
        d[k] = moved
        start += size
    if tied:
        weights["head"] = weights["embed"]
