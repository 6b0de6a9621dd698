"""kvfence's GGUF reader (gguf_loader.open_gguf: the library's reader over a plain view of the
mmap, for start-up speed) reads exactly what the library's own reader reads from the bundled file:
every metadata field with its types and value, and every tensor's name, type, shape and bytes."""
from __future__ import annotations

import gguf
import numpy as np

from kvfence.model.gguf_loader import _field_value, open_gguf
from kvfence.model.loader import default_model_path


def test_fields_and_tensors_equal_the_library_readers():
    path = default_model_path()
    ours, stock = open_gguf(path), gguf.GGUFReader(str(path))
    assert type(ours) is not gguf.GGUFReader and isinstance(ours, gguf.GGUFReader)
    assert list(ours.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert _field_value(mine) == _field_value(field), name
    assert len(ours.fields["tokenizer.ggml.tokens"].data) > 40_000
    assert ours.data_offset == stock.data_offset
    assert [(t.name, int(t.tensor_type), list(t.shape), t.data_offset) for t in ours.tensors] == \
           [(t.name, int(t.tensor_type), list(t.shape), t.data_offset) for t in stock.tensors]
    for mine, theirs in zip(ours.tensors, stock.tensors):
        assert np.array_equal(np.asarray(mine.data), np.asarray(theirs.data)), mine.name
