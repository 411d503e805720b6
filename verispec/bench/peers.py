"""Peers on the same model and prompts: transformers ``generate`` and llama.cpp.

- ``hf-generate``, ``hf-prompt-lookup`` (``prompt_lookup_num_tokens=k``) and ``hf-assisted``
  (``assistant_model=draft``, constant ``num_assistant_tokens=k``) run the target's Hugging Face model
  (float32) through ``model.generate``.
- ``llama.cpp`` and ``llama.cpp-prompt-lookup`` (its ``LlamaPromptLookupDecoding`` drafter) run the
  target's GGUF file through llama-cpp-python, when that optional extra is installed.

Each is timed like our engine: wall clock around the whole request given token ids, and the time the
first new token was available.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from verispec.bench.methods import MethodConfig, RunResult, Sampling


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python is installed."""
    return importlib.util.find_spec("llama_cpp") is not None


_LLAMA_CPP_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=int(sys.argv[2]), verbose=False)
for n, _ in enumerate(llm.generate(llm.tokenize(b"Hello, my name is"), temp=0.0)):
    if n == 3:
        break
"""
"""Loads the GGUF and decodes four tokens, as the bench will."""


def child_failure(argv: list[str], timeout: float) -> str | None:
    """Run ``argv`` in a child process; None when it exits with 0, else how it failed (the signal
    that killed it, or its exit status and last line of stderr, or the timeout)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:.0f} s"
    except OSError as exc:
        return f"could not start: {exc}"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        try:
            return f"killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            return f"killed by signal {-done.returncode}"
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return f"exit status {done.returncode}" + (f": {last}" if last else "")


def llama_cpp_failure(gguf: Path, threads: int, timeout: float = 120.0) -> str | None:
    """None when llama-cpp-python loads ``gguf`` and decodes a few tokens, in a child process; else
    how it failed. A llama.cpp build can crash on a CPU it was not made for (one built here for an
    Intel Xeon with AMX segfaulted in its first decode), and a crash in-process would end the bench."""
    return child_failure([sys.executable, "-c", _LLAMA_CPP_PROBE, str(gguf), str(threads)], timeout)


def llama_cpp_failure_note(failure: str, cpu: str) -> str:
    """The bench's note for a llama.cpp build that failed its probe (``failure``, from
    :func:`llama_cpp_failure`) on a CPU named ``cpu`` (``schedule.cpu_name()``): on a CPU with AMX,
    where native builds' AMX path has segfaulted here (session 33: in ``ggml_backend_amx_mul_mat``),
    it names the fix."""
    note = f"llama.cpp failed on this machine ({failure}): llama.cpp skipped"
    if "amx" in cpu and failure.startswith("killed by"):
        note += (
            "; its AMX path has crashed on such CPUs, and a build without AMX runs"
            ' (benchmarks/README.md, "Reproduce", gives the CMAKE_ARGS)'
        )
    return note


class _Clock:
    """A transformers streamer that notes when the first new tokens arrive (the first put is the prompt)."""

    def __init__(self, start: float):
        self.start = start
        self.calls = 0
        self.first_seconds: float | None = None
        self.first_tokens = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_seconds = time.perf_counter() - self.start
            self.first_tokens = int(value.numel())

    def end(self) -> None:
        pass


class HFPeer:
    """transformers ``generate`` on the target's Hugging Face model."""

    def __init__(self, hf_model, eos_token_ids: list[int], draft_hf=None):
        self.model = hf_model
        self.draft = draft_hf
        self.eos = list(eos_token_ids)

    @torch.inference_mode()
    def run(self, prompt: list[int], cfg: MethodConfig, req: Sampling) -> RunResult:
        """Generate once; ``cfg.method`` picks plain, prompt lookup or assisted generation."""
        ids = torch.tensor([prompt], device=self.model.device)  # [1, T]
        kwargs: dict = {
            "max_new_tokens": req.max_new_tokens,
            "eos_token_id": self.eos,
            "pad_token_id": self.eos[0] if self.eos else 0,
            "attention_mask": torch.ones_like(ids),
        }
        temp = req.sampling.temperature
        if temp > 0:
            kwargs.update(
                do_sample=True,
                temperature=temp,
                top_k=req.sampling.top_k or 0,
                top_p=req.sampling.top_p or 1.0,
            )
            if req.seed is not None:
                torch.manual_seed(req.seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if cfg.method == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = cfg.k
        elif cfg.method == "hf-assisted":
            if self.draft is None:
                raise ValueError("hf-assisted needs a draft model")
            kwargs.update(
                assistant_model=self.draft,
                num_assistant_tokens=cfg.k,
                num_assistant_tokens_schedule="constant",
            )
        start = time.perf_counter()
        clock = _Clock(start)
        out = self.model.generate(ids, streamer=clock, **kwargs)
        seconds = time.perf_counter() - start
        new = out[0, ids.shape[1] :].tolist()
        if self.eos:  # drop padding after an EOS (batch of one: only when it stopped on EOS)
            for i, tok in enumerate(new):
                if tok in self.eos:
                    new = new[: i + 1]
                    break
        return RunResult(
            token_ids=new,
            seconds=seconds,
            first_token_seconds=clock.first_seconds or seconds,
            first_tokens=clock.first_tokens or 1,
        )


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the target's GGUF file: plain and with prompt lookup."""

    def __init__(self, gguf: Path, eos_token_ids: list[int], *, n_ctx: int, threads: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common = {
            "model_path": str(gguf),
            "n_ctx": n_ctx,
            "n_threads": threads,
            "n_threads_batch": threads,
            "verbose": False,
        }
        self.plain = Llama(**common)
        self.lookup_drafter = LlamaPromptLookupDecoding()
        # logits_all sizes the score buffer a drafter needs (llama-cpp-python forgets to with draft_model).
        self.lookup = Llama(draft_model=self.lookup_drafter, logits_all=True, **common)
        self.eos = set(eos_token_ids) | {int(self.plain.token_eos())}
        self.gguf = gguf

    def run(self, prompt: list[int], cfg: MethodConfig, req: Sampling) -> RunResult:
        """Generate once; ``cfg.k`` is the prompt-lookup drafter's ``num_pred_tokens``."""
        llm = self.plain
        if cfg.method == "llama.cpp-prompt-lookup":
            llm = self.lookup
            self.lookup_drafter.num_pred_tokens = cfg.k
        temp = req.sampling.temperature
        if temp > 0 and req.seed is not None:
            llm.set_seed(req.seed)
        sampling = {
            "temp": temp,
            "top_k": req.sampling.top_k or 0,
            "top_p": req.sampling.top_p or 1.0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
        }
        llm.reset()  # no reuse of the previous prompt's cache: every method starts cold
        start = time.perf_counter()
        first = None
        out: list[int] = []
        for tok in llm.generate(prompt, reset=True, **sampling):
            if first is None:
                first = time.perf_counter() - start
            out.append(int(tok))
            if tok in self.eos or len(out) >= req.max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return RunResult(token_ids=out, seconds=seconds, first_token_seconds=first or seconds, first_tokens=1)
