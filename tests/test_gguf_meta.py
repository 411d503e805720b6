"""Reading a GGUF file's token count from its header, and refusing a draft by it before converting."""

from __future__ import annotations

import argparse

import pytest

from verispec.models.gguf_meta import GGUFFormatError, array_length, vocab_size


def write_gguf(path, tokens: list[str], *, before_tokens: bool = True) -> None:
    """A GGUF file with metadata of every kind the reader skips, and ``tokens`` as its token list."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    if before_tokens:  # values of each kind ahead of the key the reader looks for
        writer.add_string("general.name", "tiny")
        writer.add_uint32("llama.block_count", 2)
        writer.add_float32("llama.rope.freq_base", 10000.0)
        writer.add_bool("tokenizer.ggml.add_bos_token", False)
        writer.add_array("tokenizer.ggml.merges", ["a b", "ab c"])
        writer.add_array("tokenizer.ggml.scores", [0.5] * len(tokens))
    writer.add_token_list(tokens)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_tensor("w", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("before_tokens", [True, False])
def test_token_count_read_past_every_kind_of_value(tmp_path, before_tokens):
    path = tmp_path / "tiny.gguf"
    tokens = [f"t{i}" for i in range(37)]
    write_gguf(path, tokens, before_tokens=before_tokens)
    assert vocab_size(path) == 37
    assert array_length(path, "tokenizer.ggml.merges") == (2 if before_tokens else None)
    assert array_length(path, "general.name") is None  # not an array
    assert array_length(path, "no.such.key") is None


def test_other_files_give_no_token_count(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert vocab_size(text) is None and vocab_size(tmp_path / "missing.gguf") is None
    with pytest.raises(GGUFFormatError):
        array_length(text, "tokenizer.ggml.tokens")
    cut = tmp_path / "cut.gguf"
    write_gguf(tmp_path / "whole.gguf", ["a", "b"])
    cut.write_bytes((tmp_path / "whole.gguf").read_bytes()[:40])  # ends inside the header
    assert vocab_size(cut) is None


def test_packaged_default_model_count_is_its_tokenizers(default_model_folder):
    from transformers import AutoTokenizer

    from verispec.models.loading import gguf_vocab_size

    assert gguf_vocab_size("default") == len(AutoTokenizer.from_pretrained(default_model_folder))
    assert gguf_vocab_size(str(default_model_folder)) is None  # a folder: no header to read


@pytest.fixture
def other_gguf_unconverted(tmp_path, monkeypatch):
    """A GGUF draft of 100 tokens, and any conversion of a GGUF file failing the test."""
    from verispec.models import loading

    def no_conversion(*_args, **_kwargs):
        raise AssertionError("converted a GGUF file to check its tokenizer")

    monkeypatch.setattr(loading, "converted_folder", no_conversion)
    draft = tmp_path / "other.gguf"
    write_gguf(draft, [f"t{i}" for i in range(100)])
    return draft


def test_gguf_draft_of_another_size_is_refused_before_converting(other_gguf_unconverted):
    from verispec.commands.common import check_model_arguments
    from verispec.tokenizers import TokenizerMismatchError

    draft = other_gguf_unconverted
    args = argparse.Namespace(
        model="default", draft_model=str(draft), prompt_lookup=False, num_speculative_tokens=4, ngrams=None
    )
    with pytest.raises(TokenizerMismatchError, match=r"vocabulary sizes differ \(target 49152, draft 100\)"):
        check_model_arguments(args)


def test_loaded_target_refuses_a_gguf_draft_of_another_size(tiny_model_folder, other_gguf_unconverted):
    from verispec import load_model
    from verispec.commands.drafters import build_proposer
    from verispec.tokenizers import TokenizerMismatchError

    target = load_model(str(tiny_model_folder))
    draft = other_gguf_unconverted
    with pytest.raises(TokenizerMismatchError, match=r"\(target 49152, draft 100\)"):
        build_proposer(target, str(draft), False)


def test_conversion_parses_each_gguf_file_once_and_restores_the_module(tmp_path):
    import gguf

    from verispec.models.loading import _gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    write_gguf(path, ["a", "b", "c"])
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError), _gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same file: parsed once
        assert len(first.fields["tokenizer.ggml.tokens"].data) == 3
        arch = next(iter(gguf.MODEL_ARCH_NAMES))
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("a conversion that fails")
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_map
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_architecture_string_read_from_the_header(tmp_path):
    from verispec.models.gguf_meta import string_value

    path = tmp_path / "tiny.gguf"
    write_gguf(path, ["a", "b"])
    assert string_value(path, "general.architecture") == "llama"
    assert string_value(path, "general.name") == "tiny"
    assert string_value(path, "llama.block_count") is None  # not a string
    assert string_value(path, "no.such.key") is None and string_value(tmp_path / "none.gguf", "x") is None


def test_kernel_compiled_meanwhile_only_where_it_can_be(monkeypatch):
    from verispec.models import fast_llama

    monkeypatch.setenv("VERISPEC_NO_KERNEL", "1")
    assert fast_llama.compile_kernel_meanwhile("llama") is None
    monkeypatch.delenv("VERISPEC_NO_KERNEL")
    assert fast_llama.compile_kernel_meanwhile("gemma3") is None  # not the fast path's
    if fast_llama.kernel_available():  # loaded already: nothing to start
        assert fast_llama.compile_kernel_meanwhile("llama") is None
