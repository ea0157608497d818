import numpy as np
import pytest
import torch

from fedattr.updates import UpdateLayout, add_update


def test_dict_roundtrip_is_order_independent(lora_updates):
    u = lora_updates[0]
    layout = UpdateLayout.of(u)
    shuffled = dict(reversed(list(u.items())))
    flat = layout.flatten(shuffled)
    assert flat.shape == (layout.size,) and layout.size == 4 * 64
    back = layout.unflatten(flat)
    assert set(back) == set(u)
    for k in u:
        assert back[k].dtype == u[k].dtype and torch.equal(back[k], u[k])


def test_tensor_roundtrip_keeps_shape_and_dtype():
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    layout = UpdateLayout.of(t)
    assert torch.equal(layout.unflatten(layout.flatten(t)), t)


def test_layout_mismatch_is_a_clear_error(lora_updates):
    layout = UpdateLayout.of(lora_updates[0])
    bad = dict(lora_updates[1])
    bad["q.lora_A"] = torch.zeros(5, 16)
    with pytest.raises(ValueError, match="does not match this round's layout"):
        layout.flatten(bad)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        UpdateLayout.of([1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        UpdateLayout.of({})


def test_add_update_tensor_and_partial_dict():
    params = {"a": torch.ones(2), "frozen": torch.zeros(3)}
    out = add_update(params, {"a": torch.ones(2)})
    assert torch.equal(out["a"], torch.full((2,), 2.0)) and out["frozen"] is params["frozen"]
    with pytest.raises(KeyError):
        add_update(params, {"nope": torch.ones(1)})
    assert np.allclose(add_update(torch.ones(3), torch.ones(3)).numpy(), 2.0)
