"""The CPU weights' move into one arena on transparent huge pages (worker/weight_arena.py)."""
import sys

import pytest
import torch
from torch import nn

from lane.worker.weight_arena import move_weights_to_huge_pages


class Holder(nn.Module):
    def __init__(self, shared: torch.Tensor) -> None:
        super().__init__()
        self.proj = nn.Linear(512, 384)  # a parameter of 768 KiB and a small bias
        self.blocks = torch.randint(0, 255, (300, 1024), dtype=torch.uint8)  # a tensor attribute
        self.shared = shared
        self.register_buffer("table", torch.randn(256, 512))  # a buffer


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only: elsewhere nothing moves")
def test_weights_move_into_one_arena_and_keep_their_values_and_sharing():
    torch.manual_seed(0)
    shared = torch.randn(640, 512).bfloat16()
    base = torch.randn(1024, 512)
    model = nn.ModuleList([Holder(shared), Holder(shared)])
    model[1].view = base[100:700]  # a view into another tensor's storage: stays where it is
    x = torch.randn(3, 512)
    before = [m.proj(x) for m in model]
    held = lambda: [t for m in model for t in (m.proj.weight, m.blocks, m.table, m.shared)]  # noqa: E731
    values = [t.clone() for t in held()]
    small_ptr, view_ptr = model[0].proj.bias.data_ptr(), model[1].view.data_ptr()

    moved = move_weights_to_huge_pages(model)

    big = [t for m in model for t in (m.proj.weight, m.blocks, m.table)] + [shared]
    assert moved >= sum(t.numel() * t.element_size() for t in big)
    ptrs = [m.proj.weight.data_ptr() for m in model] + [m.blocks.data_ptr() for m in model] + \
           [m.table.data_ptr() for m in model] + [model[0].shared.data_ptr()]
    lo = min(ptrs)
    assert lo % (2 << 20) == 0 and max(ptrs) - lo < moved  # one arena, from a huge page's boundary
    assert model[0].shared is model[1].shared  # still one tensor for both
    assert isinstance(model[0].proj.weight, nn.Parameter)
    assert model[0].proj.bias.data_ptr() == small_ptr and model[1].view.data_ptr() == view_ptr
    for m, y in zip(model, before):
        assert torch.equal(m.proj(x), y)
    for old, new in zip(values, held()):
        assert new.dtype == old.dtype and torch.equal(new, old)
