"""Benchmarking: ``verispec bench`` (methods and peers on Spec-Bench prompts) and ``verispec tune``.

- :mod:`~verispec.bench.prompts`: the Spec-Bench question file, selected by category.
- :mod:`~verispec.bench.measure`: machine facts, memory bandwidth, the cost of verifying k + 1 tokens
  against one, draft cost, and the expected-speedup model.
- :mod:`~verispec.bench.methods`: our methods (plain, draft model, prompt lookup, adaptive) as runs.
- :mod:`~verispec.bench.peers`: transformers ``generate`` and llama.cpp on the same prompts.
- :mod:`~verispec.bench.runner`: the interleaved loop and the per-category rows of ``results.json``.
- :mod:`~verispec.bench.report`: the Markdown table and the plots.
"""
