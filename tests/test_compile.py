"""``compile="units"``: the option, the compiled unit's wrapper, and 2-rank training against eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from osdp_lightning import OSDPConfig, OSDPStrategy
from osdp_lightning.runtime import compile as runtime_compile
from osdp_lightning.runtime.compile import compilable, compile_unit, is_compiled, recompile_user_compiled


def test_compile_option_is_checked_where_it_is_written() -> None:
    assert OSDPConfig().compile is None
    assert OSDPConfig(compile="units").compile == "units"
    assert OSDPStrategy(compile="units").compile == "units"
    with pytest.raises(ValueError, match="compile must be None"):
        OSDPConfig(compile="blocks")
    with pytest.raises(ValueError, match="compile must be None"):
        OSDPStrategy(compile=True)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


def test_leaves_stay_eager_and_copies_keep_their_own_compiled_forward() -> None:
    block, leaf = _Block(), nn.Linear(8, 8)
    assert not compile_unit(leaf, "leaf") and not is_compiled(leaf) and not compilable(leaf)
    assert compile_unit(block, "block") and compile_unit(block, "block")  # idempotent
    copied = copy.deepcopy(block)
    assert is_compiled(copied) and copied.forward.__self__ is copied
    on_meta = copied.to("meta")  # a meta call (the fake step's kind) runs the eager forward
    assert on_meta(torch.empty(2, 8, device="meta")).is_meta


def test_a_module_the_user_compiled_in_place_is_compiled_per_unit() -> None:
    root = nn.Sequential(_Block(), nn.Linear(8, 8))
    root[0].compile()
    assert recompile_user_compiled(root) == ["0"]
    assert root[0]._compiled_call_impl is None and is_compiled(root[0])


def test_a_module_the_user_wrapped_in_torch_compile_is_compiled_per_unit_and_keeps_its_keys() -> None:
    root = nn.Sequential(torch.compile(_Block()), nn.Linear(8, 8))
    keys = list(root.state_dict())
    assert recompile_user_compiled(root) == ["0"]
    wrapper = root[0]
    assert is_compiled(wrapper._orig_mod) and wrapper.forward == wrapper._orig_mod.__call__
    assert list(root.state_dict()) == keys and recompile_user_compiled(root) == []  # idempotent
    on_meta = root.to("meta")  # the fake step's kind of call: through the wrapper, eagerly
    assert on_meta(torch.empty(2, 8, device="meta")).is_meta


def test_a_unit_that_cannot_be_compiled_runs_eagerly_with_a_warning_naming_it(monkeypatch) -> None:
    class Odd(_Block):
        pass

    def failing_backend(graph: torch.fx.GraphModule, inputs: list) -> None:
        raise NotImplementedError("this backend compiles nothing")

    monkeypatch.setattr(runtime_compile, "BACKEND", failing_backend)
    block = Odd()
    compile_unit(block, "net.odd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = block(torch.ones(2, 8))
    assert out.shape == (2, 8) and not is_compiled(block)
    assert any("net.odd" in str(w.message) and "runs uncompiled" in str(w.message) for w in caught)


def test_compiled_units_train_as_eager_ones_on_two_ranks(train) -> None:
    """Every block zero3+ckpt: compiled after its checkpointing and before its fully_shard."""
    common = ("--model", "tied_lm", "--uniform", "zero3", "--activation-checkpointing", "always", "--steps", "8")
    eager = train("eager", *common)
    compiled = train("compiled", *common, "--compile", "units")
    names = compiled[0]["compiled_units"]
    assert len(names) == 2 and names[0].endswith("blocks.layers.0") and names[1].endswith("blocks.layers.1"), names
    assert compiled[0]["setup_s"]["compile_s"] > 0
    assert "compile_s" not in eager[0]["setup_s"]
    for e, c in zip(eager, compiled, strict=True):
        assert len(c["losses"]) == 8
        assert c["losses"] == pytest.approx(e["losses"], rel=1e-4)
    # blocks the user wrapped in torch.compile: compiled the same way, their wrappers kept
    wrapped = train("wrapped", *common, "--user-compile")
    assert [n.endswith(f"blocks.layers.{i}._orig_mod") for i, n in enumerate(wrapped[0]["compiled_units"])] == [True] * 2
    for e, w in zip(eager, wrapped, strict=True):
        assert w["losses"] == pytest.approx(e["losses"], rel=1e-4)
