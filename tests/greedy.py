"""The tiny target's own greedy continuation of a chat, one prompt at a time (no padding): what
every reply `datagen` writes must equal (tests/workload/test_datagen.py, tests/operator/)."""

from __future__ import annotations

import json
from pathlib import Path


class Greedy:
    """greedy(messages) -> the target's greedy reply to them (cached)."""

    def __init__(self, target: Path, max_new: int, max_len: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.tok = AutoTokenizer.from_pretrained(target)
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.max_new = max_new
        self.max_len = max_len or self.model.config.max_position_embeddings
        self.cache: dict[str, str] = {}

    def __call__(self, messages: list[dict]) -> str:
        import torch

        key = json.dumps(messages)
        if key not in self.cache:
            text = self.tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)  # fmt: skip
            ids = self.tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            eos = self.tok.eos_token_id
            with torch.no_grad():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=eos,
                    pad_token_id=self.tok.pad_token_id,
                    max_new_tokens=min(self.max_new, self.max_len - ids.shape[1]),
                )[0, ids.shape[1] :].tolist()  # fmt: skip
            out = out[: out.index(eos)] if eos in out else out
            self.cache[key] = self.tok.decode(out, skip_special_tokens=True)
        return self.cache[key]
