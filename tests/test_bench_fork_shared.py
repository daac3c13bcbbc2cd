"""`metaloom bench fork --case shared` on a tiny model: both sides measured on the same forked
state, every cell reported, and bad sizes refused with errors naming the parameter."""

import pytest

from metaloom.bench.fork import _ints
from metaloom.bench.fork_shared import measure_shared
from metaloom.errors import InvalidParameter
from metaloom.models.kernels.fused import kernels
from tests.test_fused import _tiny

KERNELS = kernels().kernels
needs = pytest.mark.skipif(KERNELS is None, reason=f"no fused kernels here: {kernels().reason}")


@needs
def test_measure_shared_reports_both_sides_per_cell():
    model = _tiny().with_fused(KERNELS)
    result = measure_shared(model, [40, 70], [2, 5], tokens=2, repeats=1, calls=2)
    cells = result["cells"]
    assert [(c["prefix_tokens"], c["rows"]) for c in cells] == [(40, 2), (40, 5), (70, 2), (70, 5)]
    for c in cells:
        for side in ("on", "off"):
            assert c[side]["attention_s"] > 0 and c[side]["step_s"] > 0
        assert c["attention_speedup"] == pytest.approx(c["off"]["attention_s"] / c["on"]["attention_s"])


@needs
def test_measure_shared_refuses_what_it_cannot_measure():
    model = _tiny().with_fused(KERNELS)
    with pytest.raises(InvalidParameter, match="prefixes"):
        measure_shared(model, [model.max_context], [2])
    with pytest.raises(InvalidParameter, match="tokens"):
        measure_shared(model, [10], [2], tokens=0)
    with pytest.raises(InvalidParameter, match="model"):
        measure_shared(_tiny(), [10], [2])  # no fused kernels: nothing to compare
    with pytest.raises(InvalidParameter, match="model"):
        measure_shared(_tiny("mistral", sliding_window=6).with_fused(KERNELS), [10], [2])


def test_size_lists_parse_or_name_the_flag():
    assert _ints("rows", "16,64") == [16, 64]
    for bad in ("", "0", "16,x", "-4"):
        with pytest.raises(InvalidParameter, match="rows"):
            _ints("rows", bad)


def test_a_copied_fork_copies_an_int8_pools_scales_too():
    import torch

    from metaloom.bench.fork import copied
    from metaloom.models.engine.options import EngineOptions

    model = _tiny().with_options(EngineOptions(kv_dtype="int8"))
    cache = model.new_cache(1, 20)
    model.forward(torch.randint(0, 103, (1, 12), generator=torch.Generator().manual_seed(0)), cache)
    fork = copied(cache, [0, 0])
    assert set(fork.slots[0, :12].tolist()).isdisjoint(cache.slots[0, :12].tolist())  # copies, not shared slots
    for layer in range(2):
        keys, values = cache.gather(layer, 12)
        fk, fv = fork.gather(layer, 12)
        assert torch.equal(fk[1], keys[0]) and torch.equal(fv[0], values[0])
