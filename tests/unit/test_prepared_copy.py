"""A prepared commit copies into the live storage (issue 19); no vLLM needed.

``ModuleSwap.apply`` on real torch modules: every tensor whose layout matches keeps
its object and address and gets the new values; a changed shape is swapped in as a
new object; a tensor shared by two modules (tied) is copied once; non-tensor state
is swapped.
"""

from __future__ import annotations

import torch

from subscriber_ext.vllm_ext.apply.prepare import ModuleSwap, PreparedVersion
from subscriber_ext.vllm_ext.apply.streams import PrepStream


def _swap(name: str, live: torch.nn.Module, params: dict, buffers: dict | None = None,
          attrs: dict | None = None) -> ModuleSwap:
    return ModuleSwap(name, live, params, buffers if buffers is not None else dict(live._buffers),
                      set(live._non_persistent_buffers_set), attrs or {}, [])


def test_matching_tensors_are_copied_into_the_live_storage() -> None:
    live = torch.nn.LayerNorm(8)
    live.register_buffer("scale", torch.ones(3))
    weight, bias, scale = live.weight, live.bias, live.scale
    ptrs = (weight.data_ptr(), bias.data_ptr(), scale.data_ptr())
    new_w, new_b, new_s = torch.randn(8), torch.randn(8), torch.randn(3)
    handle = object()
    swap = _swap("norm", live, {"weight": torch.nn.Parameter(new_w.clone()),
                                "bias": torch.nn.Parameter(new_b.clone())},
                 {"scale": new_s.clone()}, {"handle": handle})
    assert swap.moved() == []
    PreparedVersion(1, "p", swaps=[swap], stream=PrepStream(torch.device("cpu"))).swap()
    assert live.weight is weight and live.bias is bias and live.scale is scale
    assert (weight.data_ptr(), bias.data_ptr(), scale.data_ptr()) == ptrs
    assert torch.equal(weight, new_w) and torch.equal(bias, new_b) and torch.equal(scale, new_s)
    assert live.handle is handle  # non-tensor state is swapped in
    assert len(swap.retired[0]) == 3  # the shadow tensors, freed off the step path


def test_a_changed_shape_is_swapped_in_and_named() -> None:
    live = torch.nn.Linear(4, 2, bias=False)
    old = live.weight
    new = torch.nn.Parameter(torch.randn(3, 4))
    swap = _swap("proj", live, {"weight": new})
    assert swap.moved() == ["proj.weight"]
    swap.apply()
    assert live.weight is new
    assert any(t is old for t in swap.retired[1])


def test_a_tied_tensor_is_copied_once_and_stays_shared() -> None:
    embed, head = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False)
    head.weight = embed.weight
    ptr = embed.weight.data_ptr()
    new = torch.nn.Parameter(torch.randn(5, 4))
    swaps = [_swap("embed", embed, {"weight": new}), _swap("head", head, {"weight": new})]
    PreparedVersion(1, "p", swaps=swaps).swap()
    assert head.weight is embed.weight and embed.weight.data_ptr() == ptr
    assert torch.equal(embed.weight, new)
