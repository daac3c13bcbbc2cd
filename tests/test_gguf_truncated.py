"""A GGUF cut short (an interrupted download or copy) is refused with an error that says so and
gives its size, not numpy's reshape complaint alone."""

import pytest

from metaloom.errors import NotAModel


@pytest.mark.parametrize("keep", [100, 5_000_000, 50_000_000])
def test_a_truncated_gguf_is_refused_as_truncated(tmp_path, keep):
    from metaloom.models import load
    from metaloom.models.find import default_model_path

    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(keep))
    with pytest.raises(NotAModel, match=rf"shorter than its GGUF header says \({keep:,} bytes\): truncated"):
        load(str(cut))


def test_only_a_read_past_the_end_counts_as_truncation():
    from metaloom.models.engine.gguf_file import _ran_past_the_end

    assert _ran_past_the_end(ValueError("cannot reshape array of size 3 into shape (4,)"))
    assert not _ran_past_the_end(ValueError("invalid GGUF version 7"))
    assert not _ran_past_the_end(KeyError("cannot reshape array"))
