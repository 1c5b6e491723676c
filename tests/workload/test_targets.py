"""load_target reads each weight straight onto the device (device_map), and gives the same
model as loading on the CPU and moving it: dense and hybrid tiny targets, CPU kernels patched."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from workload.drafter.targets import load_target


@pytest.mark.parametrize("kind", ["tiny_dense", "tiny_hybrid"])
def test_load_target_onto_the_device_equals_load_then_move(kind, request, monkeypatch):
    path = request.getfixturevalue(kind) / "target"
    asked = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):  # the real loader, recording how it was asked
        asked.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    model, tokenizer = load_target(path, dtype="float32", device="cpu")
    monkeypatch.undo()
    # what load_target did before: the whole model in host RAM, then moved
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                 attn_implementation="sdpa").eval()  # fmt: skip
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    # Each weight read straight onto the device: on the CPU both ways end alike, on a GPU the
    # device map is what skips the host copy (bench/gpu_check.py measures that load's host
    # memory where a GPU exists).
    assert asked[0]["device_map"] == {"": torch.device("cpu")}
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    theirs = dict(plain.state_dict())
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())
    ids = torch.tensor([tokenizer.encode("user: hello there, how are you?")])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    if kind == "tiny_hybrid":  # the linear-attention kernels run in torch off the GPU
        module = sys.modules[type(model.model.layers[0]).__module__]
        assert getattr(module.torch_chunk_gated_delta_rule, "_dflash_dispatch", False)
