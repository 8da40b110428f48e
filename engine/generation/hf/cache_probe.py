"""The probe of the transformers internals the hf slot cache (engine.generation.hf.slot_cache)
relies on: StaticLayer's fields, read and set from outside the class.

The slot cache sets a layer's `cumulative_length` (the column its next `update` writes), and
for an eager decode over a window it hands the step views of `keys` / `values` with
`max_cache_len` set to the window's width, putting the layer's own tensors back afterwards
(transformers 5.x, written against 5.19). `static_layer_problem` runs a tiny StaticLayer the way
the slot cache does and names the first field that no longer behaves so (None: all hold):
`lazy_initialization` allocates [batch, heads, max_cache_len, head_dim] tensors marked static for
torch.compile (`mark_static_address`), `update` writes at `cumulative_length` into the layer's
tensors in place (returning them) and also through a window's views, and `get_mask_sizes` reads
`max_cache_len`, and `is_compileable` is a class attribute True (a lone row's step sets it False
on its layers and deletes that again). The slot cache refuses to start, naming it, instead of decoding wrong numbers.
Passing another `layer_class` (tests hand it a changed fake) shows that a change is caught.
"""
from __future__ import annotations

import functools

import torch
import transformers
from transformers.cache_utils import StaticLayer


def _problem(layer_class) -> str | None:
    name = f"transformers {transformers.__version__} {layer_class.__name__}"
    for field in ("lazy_initialization", "update", "get_mask_sizes"):
        if not callable(getattr(layer_class, field, None)):
            return f"{name}.{field} is gone"
    if getattr(layer_class, "is_compileable", None) is not True:
        return (f"{name}.is_compileable is no longer True (the slot cache clears it for a lone "
                "row's step, so that transformers drops an all-ones mask)")
    layer = layer_class(max_cache_len=4)
    if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
        return f"{name}.cumulative_length is no longer a tensor (the column `update` writes)"
    empty = torch.zeros((2, 1, 0, 2))
    layer.lazy_initialization(empty, empty)
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not (isinstance(keys, torch.Tensor) and keys.shape == (2, 1, 4, 2)
            and isinstance(values, torch.Tensor) and getattr(layer, "is_initialized", False)):
        return (f"{name}.lazy_initialization no longer allocates `keys` / `values` of "
                "[batch, heads, max_cache_len, head_dim] and sets `is_initialized`")
    if getattr(keys, "_dynamo_static_input_type", None) is None:
        return f"{name}.lazy_initialization no longer marks `keys` static (mark_static_address)"
    layer.cumulative_length.fill_(2)
    new = torch.ones((2, 1, 1, 2))
    out = layer.update(new, 2 * new)
    if layer.keys is not keys or out[0] is not keys or keys[:, :, 2].ne(1).any() \
            or keys.sum() != 4 or values[:, :, 2].ne(2).any():
        return (f"{name}.update no longer writes the column `cumulative_length` into the "
                "layer's own `keys` / `values` in place")
    layer.keys, layer.values, layer.max_cache_len = keys[:, :, 1:3], values[:, :, 1:3], 2
    layer.cumulative_length.fill_(1)
    layer.update(3 * new, 3 * new)
    sizes = layer.get_mask_sizes(1)
    layer.keys, layer.values, layer.max_cache_len = keys, values, 4
    if keys[:, :, 2].ne(3).any() or keys.sum() != 12:
        return f"{name}.update no longer writes through views set as `keys` / `values`"
    if tuple(sizes) != (2, 0):
        return f"{name}.get_mask_sizes no longer reads `max_cache_len` ({tuple(sizes)} != (2, 0))"
    return None


@functools.cache
def static_layer_problem(layer_class=StaticLayer) -> str | None:
    """What of `layer_class` (transformers' StaticLayer) no longer behaves as the slot cache
    expects (module docstring), or None; computed once per class."""
    try:
        with torch.no_grad():
            return _problem(layer_class)
    except Exception as e:  # noqa: BLE001 - a changed signature is a changed field
        return (f"transformers {transformers.__version__} {layer_class.__name__} no longer "
                f"runs as the slot cache uses it: {type(e).__name__}: {e}")
