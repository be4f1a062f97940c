"""HotPathModule's mirrored members: once mirrored, every attribute read gives what nn.Module's own lookup would,
whatever changes the members afterwards; a loaded model is mirrored."""

import copy

import pytest
import torch
from torch import nn

from folio.models.dense_linear import DenseLinearMethod
from folio.models.hot_path import HotPathModule, mirror_members
from folio.models.layers import RMSNorm, RotaryEmbedding
from folio.models.linear import Linear


class Block(HotPathModule):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(8, 1e-6)
        nn.init.normal_(self.norm.weight)  # RMSNorm's weight is left for the loader: uninitialised memory, maybe NaN
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("table", torch.arange(8.0), persistent=False)
        self.plain = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x * self.scale + self.table)


def members(module: nn.Module) -> dict:
    """What nn.Module's own lookup gives for each member name (its dicts, not the instance dict)."""
    out = {}
    for table in (module._parameters, module._buffers, module._modules):
        out.update(table)
    return out


def assert_mirrored(module: HotPathModule) -> None:
    for name, value in members(module).items():
        assert getattr(module, name) is value, name
        assert module.__dict__[name] is value, name  # read from the instance dict, not through __getattr__


def test_mirrored_members_are_the_modules_own_and_forward_is_unchanged():
    block = Block()
    x = torch.randn(2, 8)
    before = block(x)
    mirror_members(block)
    assert_mirrored(block)
    assert_mirrored(block.norm)
    assert torch.equal(block(x), before)
    assert block.plain == 3


@pytest.mark.parametrize("change", ["set_parameter", "set_none", "register_buffer", "set_buffer", "set_module",
                                    "to_dtype", "delete"])
def test_the_mirror_follows_every_change_of_a_member(change):
    block = Block()
    mirror_members(block)
    if change == "set_parameter":
        block.scale = nn.Parameter(torch.full((8,), 2.0))
    elif change == "set_none":
        block.scale = None
    elif change == "register_buffer":
        block.register_buffer("table", torch.zeros(8), persistent=False)
    elif change == "set_buffer":
        block.table = torch.ones(8)
    elif change == "set_module":
        block.norm = RMSNorm(8, 1e-5)
    elif change == "to_dtype":
        block.to(torch.float64)
        assert block.table.dtype == torch.float64 and block.scale.dtype == torch.float64
    elif change == "delete":
        del block.table
        assert "table" not in block.__dict__ and not hasattr(block, "table")
        return
    assert_mirrored(block)
    if change != "set_module":  # a module set afterwards is not mirrored itself (its reads take nn.Module's way)
        assert_mirrored(block.norm)


def test_rotary_tables_stay_float32_and_mirrored_through_a_dtype_cast():
    rotary = RotaryEmbedding(64, 128, 10000.0, None)
    rotary.mirror_members()
    rotary.to(torch.bfloat16)
    assert rotary.cos.dtype == torch.float32 and rotary.sin.dtype == torch.float32
    assert_mirrored(rotary)
    assert list(rotary.state_dict()) == []  # still not persistent


def test_a_dense_layer_whose_method_drops_its_plain_weight_reads_none():
    layer = Linear(64, 32, params_dtype=torch.bfloat16)
    layer.bind(DenseLinearMethod())
    layer.weight.data.normal_()
    layer.mirror_members()
    layer.method.process_weights_after_loading(layer)
    assert_mirrored(layer)


def test_a_deep_copy_shares_members_between_its_dicts():
    block = Block()
    mirror_members(block)
    clone = copy.deepcopy(block)
    assert_mirrored(clone)
    assert clone.scale is not block.scale


def test_a_loaded_model_is_mirrored(llama_dir):
    from folio.loader.model_loader import load_model

    loaded = load_model(llama_dir, torch.float32, 64)
    hot = [m for m in loaded.model.modules() if isinstance(m, HotPathModule)]
    assert hot
    for module in hot:
        assert_mirrored(module)
