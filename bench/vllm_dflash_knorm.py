"""Why vLLM's DFlash rounds depart from the simulation's: the drafter's context-key norm.

Run with a vLLM environment's python, the worktree on PYTHONPATH:

    PYTHONPATH=. /opt/vllm-venv/bin/python bench/vllm_dflash_knorm.py
    PYTHONPATH=. /opt/vllm-venv/bin/python bench/vllm_dflash_knorm.py --result EVAL.json \
        --config RUN.yaml --checkpoint DIR [--prompts FILE] [--max-new-tokens N]

vLLM's qwen3_dflash projects the drafter's context keys for all layers at once and normalises
them with one call, `ops.rms_norm(out, all_k [L, ctx, kv_heads, head_dim], k_norm_weights
[L, head_dim])`, meaning one weight row per layer. Part 1 calls that op as the model does and
says which weights it applied. Part 2 (given an `eval --engine vllm` result) runs the same
prompts through vLLM twice, as it ships and with the context keys normed per layer, and counts
the prompts whose rounds equal the simulated ones in the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: patchable


def op_check() -> None:
    import torch
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(2, 5, 2, 32, device=device)
    w = torch.rand(2, 32, device=device) + 0.5
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    per_layer = (out - unit * w[:, None, None]).abs().max().item()
    row0 = (out - unit * w[0]).abs().max().item()
    print(f"ops.rms_norm on {device}, weight [L, head_dim]: max error against one row per layer "
          f"{per_layer:.2e}, against row 0 for every layer {row0:.2e}")  # fmt: skip


def per_layer_norm() -> None:
    import torch
    import vllm.model_executor.models.qwen3_dflash as m

    def normalize(self, all_k):
        var = all_k.float().pow(2).mean(-1, keepdim=True)
        w = self._k_norm_weights[:, None, None, :].float()
        return (all_k.float() * torch.rsqrt(var + self._rms_norm_eps) * w).to(all_k.dtype)

    m.DFlashQwen3Model._normalize_context_k = normalize


def rounds_as_simulated(args: argparse.Namespace, patched: bool) -> tuple[int, int, float]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from workload.eval.prompts import read_prompt_set, render
    from workload.eval.run_settings import load_run_settings
    from workload.eval.vllm_offline import engine_rounds

    if patched:
        per_layer_norm()
    result = json.loads(args.result.read_text())
    settings = load_run_settings(args.config)
    tok = AutoTokenizer.from_pretrained(settings.target_path)
    items = read_prompt_set(args.prompts or Path(result["prompts_file"])).items
    items = items[: result["n_prompts"]]
    ids = [render(tok, it, settings.chat_template, result["fingerprint"]["chat_template_kwargs"])
           for it in items]  # fmt: skip
    block = result["block_size"]
    llm = LLM(model=str(settings.target_path), dtype=result["fingerprint"]["dtype"], seed=0,
              enforce_eager=True, disable_log_stats=False, per_request_spec_decode_metrics="detailed",
              max_model_len=max(map(len, ids)) + result["max_new_tokens"] + block + 1,
              speculative_config={"method": "dflash", "model": str(args.checkpoint),
                                  "num_speculative_tokens": block - 1})  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=result["max_new_tokens"], ignore_eos=True,
                            stop_token_ids=args.stop_ids, detokenize=False)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    same, taus = 0, []
    for i, out in enumerate(outs):
        c = out.outputs[0]
        steps = list(c.spec_decode_metrics.per_step_accepted)
        rounds, _ = engine_rounds(
            list(c.token_ids), steps, len(ids[i]), result["max_new_tokens"], block
        )
        got = [r.produced for r in rounds]
        same += got == result["prompts"][i]["checkpoint"]["simulated"]["rounds"]
        taus.append(sum(got) / len(got) if got else 0.0)
    return same, len(outs), sum(taus) / len(taus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--result", type=Path, help="an `eval --engine vllm` result")
    p.add_argument("--config", type=Path)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--prompts", type=Path)
    p.add_argument("--stop-ids", type=lambda s: [int(x) for x in s.split(",")], default=[2],
                   help="the target's stop ids (the tiny target's <|im_end|> is 2)")  # fmt: skip
    p.add_argument("--patched", action="store_true", help="norm the context keys per layer")
    args = p.parse_args()
    op_check()
    if args.result is None:
        return
    same, n, tau = rounds_as_simulated(args, args.patched)
    result = json.loads(args.result.read_text())
    kind = "context keys normed per layer" if args.patched else "as vLLM ships"
    print(f"vLLM {kind}: rounds as simulated on {same}/{n} prompts, tau {tau:.4f} "
          f"(simulated {result['simulation']['tau']:.4f})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
