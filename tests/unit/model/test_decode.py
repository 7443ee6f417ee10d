"""Which config group the exact-decode fallback assigns each layer: compressed-tensors' own
rule (most specific target wins), whatever the groups' order. A fit export lists its 8-bit
overrides by name and the 4-bit base as "Linear"; before this rule the decode took the later
group, decoded 8-bit layers as 4-bit and failed verify on a correct export."""

from __future__ import annotations

import pytest
import torch

from quantize.model.decode import layer_groups
from quantize.model.qconfig import parse


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.lm_head = torch.nn.Linear(64, 8)


def _args(bits: int) -> dict[str, object]:
    return {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group",
            "group_size": 64}


@pytest.mark.parametrize("named_first", [True, False])
def test_named_override_beats_class_target_in_either_order(named_first: bool) -> None:
    named = {"targets": ["a"], "weights": _args(8)}
    base = {"targets": ["Linear"], "weights": _args(4)}
    groups = [named, base] if named_first else [base, named]
    qc = parse({"quant_method": "compressed-tensors", "format": "pack-quantized",
                "ignore": ["lm_head"],
                "config_groups": {f"group_{i}": g for i, g in enumerate(groups)}})
    got = {name: g.weights.num_bits for name, g in layer_groups(Two(), qc).items()}
    assert got == {"a": 8, "b": 4}
