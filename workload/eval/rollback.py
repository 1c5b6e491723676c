"""Put a target's cache back to a committed length after a verify forward, hybrid targets too.

Attention layers keep K/V per position, so a crop removes the rejected positions. A Gated
DeltaNet (linear-attention) layer keeps one recurrent state and the last inputs of its short
convolution: no crop can undo a token folded into them. So `VerifyCache.before_verify` copies
those states, and `VerifyCache.keep` crops the attention layers, puts the copies back and runs
the target over the kept tokens again. The cache is then the one that decoding only the kept
tokens would have left, bit for bit (the same computation on the same inputs); when a round
keeps every verified token, nothing is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

# (conv states, recurrent states) of one linear-attention layer, by state index
LayerStates = tuple[dict[int, Tensor | None], dict[int, Tensor | None]]


def new_cache(config: Any, *, recording: bool = True) -> Any:
    """A DynamicCache for `config`. `recording` keeps a linear layer's convolution inputs until
    the next crop (what a crop needs); plain decoding leaves it off (they would only grow)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if recording and hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def crop(cache: Any, length: int) -> None:
    """Attention layers back to `length` positions (linear layers: convolution inputs trimmed)."""
    cache.crop(-(cache.get_seq_length() - length))


def linear_layers(cache: Any) -> list[Any]:
    """The cache layers that hold recurrent state (Gated DeltaNet and the like)."""
    return [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]


def _copy(states: dict[int, Tensor | None]) -> dict[int, Tensor | None]:
    return {i: None if t is None else t.clone() for i, t in states.items()}


class VerifyCache:
    """A target cache for draft-and-verify: `before_verify()`, one forward over a block at
    `start`, then `keep(start, n, tokens, forward)` leaves positions < start + n."""

    def __init__(self, config: Any) -> None:
        self.cache = new_cache(config)
        self.saved: list[tuple[Any, LayerStates]] = []
        self.recomputed = 0  # tokens run again after a rollback

    @property
    def hybrid(self) -> bool:
        return bool(linear_layers(self.cache))

    def before_verify(self) -> None:
        self.saved = [
            (layer, (_copy(layer.conv_states), _copy(layer.recurrent_states)))
            for layer in linear_layers(self.cache)
        ]

    def keep(
        self,
        start: int,
        n: int,
        tokens: list[int],
        forward: Callable[[list[int], int], Any],
    ) -> None:
        """Keep the first n of the verified tokens `tokens` (placed at start..): crop, and for
        linear layers restore the states saved before the verify and run forward(tokens[:n],
        start) from them."""
        if not self.saved or start + n == self.cache.get_seq_length():
            crop(self.cache, start + n)
            return
        crop(self.cache, start)
        for layer, (conv, recurrent) in self.saved:
            layer.conv_states, layer.recurrent_states = conv, recurrent
        self.saved = []
        forward(tokens[:n], start)
        crop(self.cache, start + n)  # trims the convolution inputs the forward recorded
        self.recomputed += n
