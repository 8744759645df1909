"""Each mixer as a layer on its own, made from explicit arguments (no model, no config): the
same function as inside a model, its cache, its initialisation, its argument errors."""

from __future__ import annotations

import pytest
import torch

from trellis_lm import TrellisCache, TrellisConfig
from trellis_lm.mixers import MIXERS

SIZES = dict(hidden_size=24, num_heads=3, head_dim=6)
# Each kind's own fields at small, odd sizes.
FIELDS = {
    "trellis": dict(num_slots=5, chunk_size=3, conv_size=3),
    "lattice": dict(num_slots=5, chunk_size=3),
    "kvm": dict(kvm_chunk_size=3, kvm_window_chunks=1, kvm_state_size=4, kvm_rope_dims=2, kvm_sinks=1),
    "attention": dict(num_key_value_heads=1),
}


def standalone(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MIXERS[kind](**SIZES, **FIELDS[kind]).double().eval()


@pytest.mark.parametrize("kind", sorted(FIELDS))
def test_a_standalone_layer_is_the_models_layer(kind):
    layer = standalone(kind)
    config = TrellisConfig(**SIZES, **FIELDS[kind], vocab_size=50, intermediate_size=32, num_hidden_layers=2,
                           mixer_types=[kind, kind])
    config._attn_implementation = "sdpa"  # what a model sets on loading, and a standalone layer by default
    inside = MIXERS[kind].from_config(config, 1).double().eval()
    inside.load_state_dict(layer.state_dict())
    x = torch.randn(2, 10, SIZES["hidden_size"], dtype=torch.float64)
    torch.testing.assert_close(layer(x), inside(x), rtol=1e-12, atol=1e-12)
    # With a cache of its own: a prefill then single-token steps give the whole call's outputs.
    cache = TrellisCache(layer.config)
    pieces = [layer(x[:, :6], None, cache)] + [layer(x[:, t : t + 1], None, cache) for t in range(6, 10)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), layer(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", sorted(FIELDS))
def test_a_standalone_layer_is_initialised_as_in_a_model(kind):
    layer = standalone(kind, seed=3)
    for name, parameter in layer.named_parameters():
        assert torch.isfinite(parameter).all(), name
    # The learned initial memories follow the mixer's own rule, not left as allocated: Trellis's
    # drawn N(0, 1), Lattice's orthonormal slots.
    for name in ("mk0", "mv0"):
        if hasattr(layer, name):
            assert 0.5 < float(getattr(layer, name).std()) < 1.5, name
    if hasattr(layer, "s0"):
        norms = layer.s0.norm(dim=-1)
        torch.testing.assert_close(norms, torch.ones_like(norms), rtol=1e-6, atol=1e-6)
    projection = layer.q_proj.weight.detach()
    assert float(projection.std()) == pytest.approx(layer.config.initializer_range, rel=0.3)


def test_standalone_arguments_are_checked():
    trellis = MIXERS["trellis"]
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['slots'\]"):
        trellis(**SIZES, slots=4)
    with pytest.raises(TypeError, match=r"needs the keyword arguments \['head_dim'\]"):
        trellis(hidden_size=24, num_heads=3)
    with pytest.raises(TypeError, match="a config or keyword arguments, not both"):
        trellis(TrellisConfig(**SIZES), 0, num_slots=4)
    with pytest.raises(ValueError, match="num_slots must be"):
        trellis(**SIZES, num_slots=0)
    # A field of another kind is not this layer's argument.
    with pytest.raises(TypeError, match="kvm_state_size"):
        trellis(**SIZES, kvm_state_size=8)


@pytest.mark.parametrize("kind", sorted(FIELDS))
def test_a_standalone_layer_refuses_what_it_cannot_read_by_name(kind):
    layer = standalone(kind)
    width = SIZES["hidden_size"]
    for x in (torch.randn(5, width), torch.randn(2, 0, width), torch.randn(2, 4, width + 1)):
        for cache in (None, TrellisCache(layer.config)):
            with pytest.raises(ValueError, match=rf"takes x \[batch, tokens >= 1, hidden_size = {width}\]"):
                layer(x.double(), None, cache)
    x = torch.randn(2, 4, width, dtype=torch.float64)
    beyond = MIXERS[kind](layer.config, 3).double()
    with pytest.raises(ValueError, match=r"layer_idx = 3 reads entry 3 of its cache, whose entries are \["):
        beyond(x, None, TrellisCache(layer.config))
    other = "attention" if kind != "attention" else "trellis"
    with pytest.raises(ValueError, match=rf"entries are \['{other}'\]"):
        layer(x, None, TrellisCache([other]))
    with pytest.raises(TypeError, match=r"takes a TrellisConfig as config, got a dict: pass a dict's fields as keyword"):
        MIXERS[kind](dict(**SIZES, **FIELDS[kind]), 0)
