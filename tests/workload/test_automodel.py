"""A trainer checkpoint loads the way the ecosystem loads drafters: AutoModel with remote code."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from tests.workload.test_train import config, group  # noqa: F401 - group is a fixture
from workload.config import recipe_layer_ids
from workload.drafter import checkpoint as ckpt
from workload.drafter import dflash_module
from workload.drafter.model import MODULE_NAME, DFlashDrafter
from workload.train import loop as T

# Run in a fresh interpreter where the workload package cannot be imported: the checkpoint's own
# module must be all AutoModel needs. Writes the outputs of two plain calls and a cached one.
LOAD_AND_RUN = """
import sys
sys.modules["workload"] = None  # any import of the workload fails
import torch
from transformers import AutoModel, DynamicCache

path, inputs, out = sys.argv[1:4]
model = AutoModel.from_pretrained(path, trust_remote_code=True).eval()
x = torch.load(inputs)
with torch.no_grad():
    plain = [model(position_ids=p, noise_embedding=x["embeds"], target_hidden=f)
             for p, f in x["calls"]]
    cache = DynamicCache(config=model.config)
    p, f = x["calls"][0]
    cached = model(position_ids=p, noise_embedding=x["embeds"], target_hidden=f,
                   past_key_values=cache, use_cache=True)
torch.save({"class": type(model).__module__ + "." + type(model).__name__,
            "ids": model.target_layer_ids, "plain": plain, "cached": cached}, out)
"""


def _inputs(model: DFlashDrafter) -> dict:
    g = torch.Generator().manual_seed(3)
    hidden = model.config.hidden_size
    width = len(model.target_layer_ids) * hidden
    feats = torch.randn(1, 12, width, generator=g)
    embeds = torch.randn(1, model.block_size, hidden, generator=g)
    calls = []
    for start, c in ((12, 12), (20, 5)):  # context rows [start - c, start), block from start
        positions = torch.arange(start - c, start + model.block_size)[None]
        calls.append((positions, feats[:, :c]))
    return {"embeds": embeds, "calls": calls}


def _ours(model: DFlashDrafter, x: dict) -> dict:
    with torch.no_grad():
        plain = [
            model(position_ids=p, noise_embedding=x["embeds"], target_hidden=f)
            for p, f in x["calls"]
        ]
        p, f = x["calls"][0]
        cache = DynamicCache(config=model.config)
        cached = model(
            position_ids=p,
            noise_embedding=x["embeds"],
            target_hidden=f,
            past_key_values=cache,
            use_cache=True,
        )
    return {"plain": plain, "cached": cached}


def test_automodel_loads_a_trainer_checkpoint_with_our_outputs(tiny_dense, tmp_path, group):  # noqa: F811
    run_dir = tmp_path / "run"
    cfg = config(tiny_dense, "optim.max_steps=2", "checkpoint.every=2")
    assert T.train(cfg, run_dir) == 0
    step = ckpt.step_dir(run_dir, 2)
    assert (step / MODULE_NAME).read_bytes() == Path(dflash_module.__file__).read_bytes()
    assert MODULE_NAME in ckpt.read_manifest(step) and ckpt.verify(step)

    ours = DFlashDrafter.from_pretrained(step).eval()
    x = _inputs(ours)
    torch.save(x, tmp_path / "inputs.pt")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "PYTHONPATH": "",
    }
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_RUN, str(step), "inputs.pt", "out.pt"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    assert theirs["class"].startswith("transformers_modules.")
    assert theirs["class"].endswith(".dflash.DFlashDraftModel")
    assert theirs["ids"] == ours.target_layer_ids
    want = _ours(ours, x)
    for got, expected in zip(theirs["plain"], want["plain"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(theirs["cached"], want["cached"], rtol=1e-6, atol=1e-6)


def test_the_shipped_module_imports_only_torch_transformers_and_the_stdlib():
    tree = ast.parse(Path(dflash_module.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import needs a second file in the checkpoint"
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) == {"torch", "transformers"}


def test_the_shipped_default_layer_ids_are_the_recipes():
    for layers in range(4, 80, 3):
        for n in (1, 3, 5, 8):
            assert dflash_module.spread_layer_ids(layers, n) == recipe_layer_ids(layers, n)
