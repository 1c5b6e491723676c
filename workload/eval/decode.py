"""DFlash decoding for evaluation: the simulator of z-lab's `dflash_generate` and the real loop.

Greedy speculative decoding is lossless: it emits the target's greedy continuation. So for a
prompt we decode that continuation once, run the target once over prompt + continuation for its
hidden states, and replay the rounds: at committed position `start` the drafter sees the
features of positions < start and the block [token at start, MASK x K-1]; the accepted length is
the number of leading draft argmaxes equal to the continuation; the round commits accepted + 1
tokens (cut at the length limit and at a stop token, as dflash_generate does). DDTree replays the
same loop with the depth a tree of the given budget reaches (drafter/acceptance.py). `real_generate` is the
real draft-and-verify loop with KV caches, which the simulation is checked against.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from workload.drafter.acceptance import build_tree, label_ranks, streak_lengths, tree_depth
from workload.drafter.model import select_target_features
from workload.drafter.targets import DraftConventions, block_embeddings, output_head
from workload.drafter.targets import draft_logits as head_logits
from workload.eval.rollback import VerifyCache, crop, new_cache

# ----------------------------------------------------------------------------- model plumbing


def draft_logits(drafter: torch.nn.Module, hidden: Tensor, head: torch.nn.Module) -> Tensor:
    """The drafter's logits through the target's head (training's code: targets.draft_logits)."""
    if hasattr(drafter, "compute_logits"):
        return drafter.compute_logits(hidden, head)
    return head_logits(hidden, head, DraftConventions.of(drafter.config))


def _target_call(
    target: torch.nn.Module,
    ids: list[int] | Tensor,
    start: int,
    cache=None,
    hidden: bool = False,
    last_only: bool = False,
):
    """One target forward over `ids` placed at positions start.., optionally with a KV cache."""
    params = _target_params(target)
    device = target.get_input_embeddings().weight.device
    ids = torch.as_tensor(ids, device=device).view(1, -1)
    kwargs: dict[str, Any] = {
        "position_ids": torch.arange(start, start + ids.shape[1], device=device)[None],
        "output_hidden_states": hidden,
    }
    if cache is not None:
        kwargs["cache" if "cache" in params else "past_key_values"] = cache
        kwargs["use_cache"] = True
    else:
        kwargs["use_cache"] = False
    if last_only and "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    return target(ids, **kwargs)


def _target_params(target: torch.nn.Module) -> frozenset[str]:
    cached = getattr(target, "_dflash_eval_params", None)
    if cached is None:
        cached = frozenset(inspect.signature(target.forward).parameters)
        target._dflash_eval_params = cached
    return cached


# ----------------------------------------------------------------------------- drafting


class DraftSession:
    """Drafts blocks like dflash_generate: the drafter's KV cache holds context K/V of positions
    < start; each call feeds the context positions not yet cached plus the block, then crops
    the cache back to start (dropping the block's K/V)."""

    def __init__(self, drafter: torch.nn.Module, target: torch.nn.Module) -> None:
        self.drafter = drafter
        self.target = target
        self.embed = target.get_input_embeddings().weight
        self.head = output_head(target)
        self.conventions = DraftConventions.of(drafter.config)
        self.mask_id = int(drafter.mask_token_id)
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.drafter.config)
        self.cached = 0  # context positions whose K/V the cache holds

    def draft(self, new_context: Tensor, token: int, start: int, size: int) -> Tensor:
        """Logits [size-1, V] of slots 1..size-1; new_context: features of cached..start-1."""
        if self.cached + new_context.shape[1] != start:
            raise ValueError(f"context covers {self.cached}+{new_context.shape[1]}, not {start}")
        device = self.embed.device
        ids = torch.tensor([[token] + [self.mask_id] * (size - 1)], device=device)
        noise = block_embeddings(self.target, ids, self.conventions)
        positions = torch.arange(self.cached, start + size, device=device)[None]
        hidden = self.drafter(
            position_ids=positions,
            noise_embedding=noise,
            target_hidden=new_context,
            past_key_values=self.cache,
            use_cache=True,
        )[:, 1 - size :, :]
        crop(self.cache, start)
        self.cached = start
        return draft_logits(self.drafter, hidden, self.head)[0]


@dataclass
class Draft:
    """What the simulations need of one drafted block."""

    argmax: list[int]  # [size-1]
    top_logprobs: list[list[float]]  # [size-1][top], descending
    top_ids: Tensor  # [size-1, top] on CPU

    @classmethod
    def from_logits(cls, logits: Tensor, top: int) -> Draft:
        logits = logits.float()
        values, ids = torch.log_softmax(logits, dim=-1).topk(min(top, logits.shape[-1]), dim=-1)
        return cls(logits.argmax(dim=-1).tolist(), values.tolist(), ids.cpu())


class DraftOracle:
    """Draft at any committed position of a known sequence, memoised by (start, size)."""

    def __init__(self, session: DraftSession, features: Tensor, seq: list[int], top: int) -> None:
        self.session, self.features, self.seq, self.top = session, features, seq, top
        self.memo: dict[tuple[int, int], Draft] = {}
        self.calls = 0

    def __call__(self, start: int, size: int) -> Draft:
        key = (start, size)
        if key not in self.memo:
            if self.session.cached > start:
                self.session.reset()
            context = self.features[:, self.session.cached : start]
            logits = self.session.draft(context, self.seq[start], start, size)
            self.memo[key] = Draft.from_logits(logits, self.top)
            self.calls += 1
        return self.memo[key]


# ----------------------------------------------------------------------------- simulation


class Round(NamedTuple):
    start: int  # committed position of the block's first token
    size: int  # block length (K, or less at the length limit)
    accepted: int  # draft tokens accepted (leading matches, or tree depth)
    produced: int  # tokens committed: accepted + 1, cut at the limit / a stop token


Accept = Callable[[Draft, list[int]], int]


def leading_matches(guesses: Sequence[int], labels: Sequence[int]) -> int:
    """Draft tokens a greedy verifier accepts: training's `streak` (acceptance.streak_lengths) of
    one block whose slots are all valid, up to the shorter of the two lists."""
    n = min(len(guesses), len(labels))
    if n == 0:
        return 0
    correct = torch.tensor(list(guesses[:n])) == torch.tensor(list(labels[:n]))
    return int(streak_lengths(correct[None], torch.ones_like(correct)[None])[0])


def chain_accept(draft: Draft, labels: list[int]) -> int:
    return leading_matches(draft.argmax, labels)


def tree_accept(budget: int) -> Accept:
    def accept(draft: Draft, labels: list[int]) -> int:
        if not labels:
            return 0
        ranks = label_ranks(draft.top_ids[: len(labels)], torch.tensor(labels)).tolist()
        return tree_depth(draft.top_logprobs, ranks, len(labels), budget)

    return accept


def simulate(
    oracle: Callable[[int, int], Draft],
    seq: list[int],
    prompt_len: int,
    max_new_tokens: int,
    block_size: int,
    stop_ids: Sequence[int],
    accept: Accept,
) -> list[Round]:
    """Replay dflash_generate's rounds over seq = prompt + the target's greedy continuation."""
    stops = set(stop_ids)
    max_length = prompt_len + max_new_tokens
    start = prompt_len
    stopped = start < len(seq) and seq[start] in stops
    rounds = []
    while start + 1 < max_length and not stopped:
        size = min(block_size, max_length - start)
        labels = seq[start + 1 : start + size]
        accepted = accept(oracle(start, size), labels)
        produced = min(accepted + 1, max_length - start - 1)
        for i in range(produced):
            if seq[start + 1 + i] in stops:
                produced, stopped = i + 1, True
                break
        rounds.append(Round(start, size, accepted, produced))
        start += produced
    return rounds


# ----------------------------------------------------------------------------- target decoding


@torch.inference_mode()
def greedy_continuation(
    target: torch.nn.Module, prompt: list[int], max_new_tokens: int, stop_ids: Sequence[int]
) -> list[int]:
    """The target's greedy tokens after `prompt`: max_new_tokens, or through the first stop."""
    stops = set(stop_ids)
    cache = new_cache(target.config, recording=False)
    out = _target_call(target, prompt, 0, cache, last_only=True)
    new = [int(out.logits[0, -1].argmax())]
    while len(new) < max_new_tokens and new[-1] not in stops:
        out = _target_call(target, [new[-1]], len(prompt) + len(new) - 1, cache, last_only=True)
        new.append(int(out.logits[0, -1].argmax()))
    return new


@torch.inference_mode()
def target_hidden_states(target: torch.nn.Module, seq: list[int]) -> tuple[Tensor, ...]:
    return _target_call(target, seq, 0, hidden=True, last_only=True).hidden_states


@torch.inference_mode()
def real_generate(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    stop_ids: Sequence[int] | None,
) -> tuple[list[int], list[int]]:
    """Greedy draft-and-verify with KV caches: (new tokens, per-round lengths). Rejected drafts
    leave the target's cache by a crop, and on hybrid targets by the rollback of rollback.py."""
    stops = set(stop_ids or ())
    tokens = [int(t) for t in input_ids.view(-1).tolist()]
    prompt_len = len(tokens)
    max_length = prompt_len + max_new_tokens
    block, layers = int(drafter.block_size), list(drafter.target_layer_ids)
    tcache, session = VerifyCache(target.config), DraftSession(drafter, target)
    out = _target_call(target, tokens, 0, tcache.cache, hidden=True, last_only=True)
    tokens.append(int(out.logits[0, -1].argmax()))
    context = select_target_features(out.hidden_states, layers)
    start, lengths = prompt_len, []
    stopped = tokens[start] in stops

    def forward(ids: list[int], at: int) -> None:
        _target_call(target, ids, at, tcache.cache, last_only=True)

    while start + 1 < max_length and not stopped:
        size = min(block, max_length - start)
        guesses = session.draft(context, tokens[start], start, size).argmax(dim=-1).tolist()
        verified = [tokens[start], *guesses]
        tcache.before_verify()
        out = _target_call(target, verified, start, tcache.cache, hidden=True)
        posterior = out.logits[0].argmax(dim=-1).tolist()
        accepted = leading_matches(guesses, posterior)
        committed = [*guesses[:accepted], posterior[accepted]]
        produced = min(accepted + 1, max_length - start - 1)
        for i in range(produced):
            if committed[i] in stops:
                produced, stopped = i + 1, True
                break
        tokens.extend(committed[:produced])
        tcache.keep(start, produced, verified, forward)
        start += produced
        context = select_target_features(out.hidden_states, layers)[:, :produced]
        lengths.append(produced)
    return tokens[prompt_len:], lengths


@torch.inference_mode()
def real_tree_generate(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    stop_ids: Sequence[int] | None,
    budget: int,
) -> tuple[list[int], list[int]]:
    """Greedy DDTree decoding verified by the target, node by node: (new tokens, per-round
    lengths). Each round drafts a block, builds its tree of `budget` nodes (ddtree.build_tree)
    and walks it: feed the root token, take the target's greedy token, and while that token is
    a child of the current node, feed it and go on. The walk commits its path and the target's
    next token; the cache keeps what was committed (rollback.py). One target call per accepted
    token: this checks what the tree accepts on real forwards, it is not a fast tree verifier."""
    stops = set(stop_ids or ())
    tokens = [int(t) for t in input_ids.view(-1).tolist()]
    prompt_len = len(tokens)
    max_length = prompt_len + max_new_tokens
    block, layers = int(drafter.block_size), list(drafter.target_layer_ids)
    tcache, session = VerifyCache(target.config), DraftSession(drafter, target)
    out = _target_call(target, tokens, 0, tcache.cache, hidden=True, last_only=True)
    tokens.append(int(out.logits[0, -1].argmax()))
    context = select_target_features(out.hidden_states, layers)
    start, lengths = prompt_len, []
    stopped = tokens[start] in stops

    def forward(ids: list[int], at: int):
        return _target_call(target, ids, at, tcache.cache, hidden=True, last_only=True)

    while start + 1 < max_length and not stopped:
        size = min(block, max_length - start)
        draft = Draft.from_logits(session.draft(context, tokens[start], start, size), budget)
        children = _tree_children(draft, budget)
        tcache.before_verify()
        fed, node, feats = [tokens[start]], -1, []
        while True:
            out = forward(fed[-1:], start + len(fed) - 1)
            feats.append(select_target_features(out.hidden_states, layers))
            want = int(out.logits[0, -1].argmax())
            node = children.get((node, want), None)
            if node is None:
                break
            fed.append(want)
        committed = [*fed[1:], want]
        produced = min(len(committed), max_length - start - 1)
        for i in range(produced):
            if committed[i] in stops:
                produced, stopped = i + 1, True
                break
        tokens.extend(committed[:produced])
        tcache.keep(start, produced, fed, forward)
        start += produced
        context = torch.cat(feats, dim=1)[:, :produced]
        lengths.append(produced)
    return tokens[prompt_len:], lengths


def _tree_children(draft: Draft, budget: int) -> dict[tuple[int, int], int]:
    """{(parent node, token): node} of the block's tree (parent -1: the root)."""
    nodes = build_tree(draft.top_logprobs, budget)
    ids = draft.top_ids.tolist()
    return {(parent, ids[depth - 1][rank]): i for i, (parent, depth, rank) in enumerate(nodes)}


def real_draft_and_verify(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    stop_ids: Sequence[int] | None,
) -> list[int]:
    """Per-round acceptance lengths (accepted + 1, as dflash_generate's acceptance_lengths)."""
    return real_generate(drafter, target, input_ids, max_new_tokens, stop_ids)[1]


# ----------------------------------------------------------------------------- one prompt


@dataclass
class PromptResult:
    chain: list[Round]
    trees: dict[int, list[Round]] = field(default_factory=dict)
    draft_s: float = 0.0


def evaluate_drafter(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    hidden_states: Sequence[Tensor],
    seq: list[int],
    prompt_len: int,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    budgets: Sequence[int],
) -> PromptResult:
    """Chain rounds and DDTree rounds per budget for one prompt's known continuation."""
    t0 = time.perf_counter()
    features = select_target_features(hidden_states, drafter.target_layer_ids)
    top = max([1, *budgets])
    oracle = DraftOracle(DraftSession(drafter, target), features, seq, top)
    block = int(drafter.block_size)
    with torch.inference_mode():
        result = PromptResult(
            simulate(oracle, seq, prompt_len, max_new_tokens, block, stop_ids, chain_accept)
        )
        for b in budgets:
            result.trees[b] = simulate(
                oracle, seq, prompt_len, max_new_tokens, block, stop_ids, tree_accept(b)
            )
    sync_device(features.device)
    result.draft_s = time.perf_counter() - t0
    return result


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
