"""Entry points that serve verispec over a network protocol (see :mod:`verispec.entrypoints.openai`)."""
