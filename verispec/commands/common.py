"""Arguments shared by generate, bench and serve, and how they become typed config."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from verispec.config import ConfigError, SamplingConfig
from verispec.models.fast_llama import DTYPES


def add_model_arguments(p: argparse.ArgumentParser, *, draft_flag: str = "--draft-model") -> None:
    """--model, the draft choice, k and weight format."""
    p.add_argument(
        "--model", default="default", help="target: packaged name, .gguf file, HF folder or hub id"
    )
    p.add_argument(
        draft_flag,
        dest="draft_model",
        default=None,
        help="draft model (same tokenizer as the target); 'default' = the shipped draft; "
        "'[ngram]' = prompt lookup, as in vLLM",
    )
    p.add_argument(
        "--prompt-lookup", action="store_true", help="draft by n-gram prompt lookup (no second model)"
    )
    add_ngrams_argument(
        p,
        "draft by prompt lookup plus an n-gram table of the target's own answers "
        "(the shipped table, or one made by `verispec ngrams`)",
    )
    p.add_argument(
        "--num-speculative-tokens", "-k", type=int, default=4, help="draft length k (0 = plain decoding)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="weight format of the fast path: float32 (exact), bfloat16, int8 (per-row scales), int4 "
        "(a Q4_1 GGUF's own layer blocks in integer products) or w4a8 (int4's weights, 8-bit activations)",
    )
    p.add_argument("--backend", default="auto", choices=["auto", "fast", "hf"], help="model implementation")
    add_device_argument(p)


def add_ngrams_argument(p: argparse.ArgumentParser, help: str) -> None:
    """``--ngrams [DIR]``: the table shipped for the target (the flag alone) or the one in DIR."""
    p.add_argument("--ngrams", nargs="?", const="default", default=None, metavar="DIR", help=help)


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """--device: where the models' weights live and their forwards run."""
    p.add_argument(
        "--device",
        default="auto",
        help="where the models run: cpu, cuda, cuda:N, or auto (the GPU when torch sees one)",
    )


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p, --seed."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="reproduces a sampled response")


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    """Validated sampling settings from parsed arguments."""
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


VLLM_NGRAM = ("[ngram]", "ngram")
"""What vLLM's ``--speculative-model`` takes for prompt lookup; here the same as ``--prompt-lookup``."""


def check_model_arguments(args: argparse.Namespace) -> None:
    """Checks that need no model, done before any loading. A draft named as vLLM names prompt
    lookup (:data:`VLLM_NGRAM`) becomes ``--prompt-lookup``."""
    if args.draft_model in VLLM_NGRAM:
        args.draft_model, args.prompt_lookup = None, True
    if args.num_speculative_tokens < 0:
        raise ConfigError(f"--num-speculative-tokens must be >= 0, got {args.num_speculative_tokens}")
    ngrams = getattr(args, "ngrams", None)
    one_drafter(
        (("--prompt-lookup", args.prompt_lookup), ("a draft model", args.draft_model), ("--ngrams", ngrams))
    )
    if ngrams not in (None, "default"):
        from verispec.ngrams import read_meta

        read_meta(Path(ngrams).expanduser())  # a clear error before any model loads
    from verispec.models.loading import resolve

    target = resolve(args.model)  # raises ModelNotFoundError with a clear message
    if args.draft_model and args.draft_model != "default":
        if not (Path(args.draft_model).expanduser() / "draft.json").is_file():  # distilled drafts load apart
            check_gguf_vocab_sizes(target, resolve(args.draft_model))


def one_drafter(options: Sequence[tuple[str, object]]) -> None:
    """Raise :class:`ConfigError` when more than one of the drafter ``options`` (``(name, value)``
    pairs; a value that is set names that drafter) is given."""
    named = [name for name, value in options if value]
    if len(named) > 1:
        raise ConfigError(f"choose one drafter: {' or '.join(named)}, not both")


def check_gguf_vocab_sizes(target: tuple[str, object], draft: tuple[str, object]) -> None:
    """Where target and draft (``(kind, location)`` as :func:`~verispec.models.loading.resolve`
    gives them) are both GGUF files, refuse a pair whose token lists differ in length (read from
    the files' headers), before either model loads."""
    from verispec.models.gguf_meta import vocab_size
    from verispec.tokenizers import check_vocab_size

    if target[0] == draft[0] == "gguf":
        sizes = vocab_size(target[1]), vocab_size(draft[1])
        if sizes[0] is not None and sizes[1] is not None:
            check_vocab_size(sizes[0], sizes[1])
