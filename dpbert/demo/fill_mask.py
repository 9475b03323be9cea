"""Fill-mask inference behind the demo: one loaded checkpoint, its verified guarantee, top-k.

`FillMaskModel.load(source)` resolves a local folder or Hub id (the release's pull path), verifies
its privacy metadata (epsilon recomputed from the ledger), and reads the tokenizer and dpbert's
Flax `BertForMaskedLM`. `predict(text, top_k=k)` returns, for each mask position in order, the k
most probable tokens with their probabilities (k <= `MAX_TOP_K`). Masks are written `[MASK]` or
as the tokenizer's own mask token.

Guarantees:
- Probabilities are `softmax(logits)` in float32 over the model's whole output vocabulary at each
  mask position, exactly what the model gives for the unpadded sentence (padding is masked out
  by the attention mask, and BERT uses absolute positions, so padding never changes a score).
- Inputs are padded to a fixed set of length buckets (powers of two from 16, capped at
  `max_position_embeddings`) and mask positions to `MAX_MASKS`, so one compile serves every
  sentence of a bucket; at most `len(buckets)` compiles per model.
- Bad input raises `FillMaskInputError` (a ValueError) whose message says what to change:
  no mask token, more than `MAX_MASKS` masks, or more tokens than the model takes.
- `mask_distribution(text)` is that softmax at the first mask, over the whole vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from transformers import AutoTokenizer

from dpbert.model import BertForMaskedLM, mlm_logits, split_params
from dpbert.release import resolve_pretrained, verify_folder
from dpbert.release.hub import has_privacy_claims
from dpbert.release.metadata import read_privacy_json
from dpbert.release.verify import GuaranteeCheck

MASK = "[MASK]"
MAX_MASKS = 5
MAX_TOP_K = 10
_SMALLEST_BUCKET = 16


class FillMaskInputError(ValueError):
    """The user's sentence cannot be scored as given; the message says why and what to do."""


@dataclass(frozen=True, kw_only=True)
class ModelPrivacy:
    """What the demo states about a model's privacy, taken from its *verified* metadata only.

    `checks` are the release's guarantees with epsilon recomputed from their ledgers
    (`dpbert.release.verify_folder`); empty when the folder makes no privacy claim at all (a plain
    Hugging Face BERT), which is shown as non-private. `vocabulary` says where the vocabulary came
    from and whether the guarantee covers it (from `privacy.json`; None for a non-private model).
    """

    checks: tuple[GuaranteeCheck, ...]
    vocabulary: str | None = None

    @property
    def private(self) -> bool:
        return bool(self.checks) and all(c.private for c in self.checks)

    def label(self) -> str:
        """E.g. 'ε = 5.36, δ = 1e-06 (pld, verified)' or 'non-private (ε = ∞)'."""
        if not self.checks:
            return "non-private (ε = ∞, no privacy metadata)"
        parts = [
            f"ε = {c.recomputed_epsilon:.3g}, δ = {c.delta:.3g} ({c.accountant}, verified)"
            if c.private
            else "non-private (ε = ∞)"
            for c in self.checks
        ]
        if len(parts) == 1:
            return parts[0]
        return "; ".join(f"{c.scope}: {part}" for c, part in zip(self.checks, parts, strict=True))

    def to_json(self) -> dict[str, Any]:
        """JSON-friendly form; epsilon is null where it is infinite (JSON has no infinity)."""
        return {
            "private": self.private,
            "label": self.label(),
            "vocabulary": self.vocabulary,
            "guarantees": [
                {
                    "scope": c.scope,
                    "epsilon": c.recomputed_epsilon if c.private else None,
                    "delta": c.delta,
                    "accountant": c.accountant,
                }
                for c in self.checks
            ],
        }


def verified_privacy(folder: str | os.PathLike[str]) -> ModelPrivacy:
    """The privacy of a local model folder; ValueError listing the problems if its claim fails."""
    if not has_privacy_claims(folder):
        return ModelPrivacy(checks=())
    result = verify_folder(folder)
    result.raise_if_failed()
    if not result.private:
        return ModelPrivacy(checks=result.checks)
    vocabulary = read_privacy_json(Path(folder)).get("vocabulary") or {}
    origin = str(vocabulary.get("origin", "not recorded")).rstrip(".")
    if not origin.lower().startswith("vocabulary"):
        origin = f"Vocabulary: {origin}"
    covered = "covered" if vocabulary.get("covered") is True else "not covered"
    return ModelPrivacy(checks=result.checks, vocabulary=f"{origin}; {covered} by the guarantee.")


def release_notes(folder: str | os.PathLike[str]) -> tuple[tuple[str, ...], str | None]:
    """From a verified release's `privacy.json`: its recipe's fill-mask sentences, and its released
    held-out figures as one line ("held-out MLM accuracy 12.3% (unigram 6.3%) on ..., step S"), None
    where the release states none (figures computed from private data are not released)."""
    data = read_privacy_json(Path(folder))
    recipe = yaml.safe_load((data.get("recipe") or {}).get("content") or "") or {}
    sentences = tuple(str(t) for t in ((recipe.get("report") or {}).get("fill_mask") or ()))
    evaluation = data.get("evaluation") or {}
    values = evaluation.get("values") or {}
    if not (evaluation.get("included") and values.get("eval_mlm_accuracy") is not None):
        return sentences, None
    line = f"held-out MLM accuracy {values['eval_mlm_accuracy']:.1%}"
    if values.get("eval_unigram_accuracy") is not None:
        line += f" (unigram baseline {values['eval_unigram_accuracy']:.1%})"
    where = "a public corpus" if evaluation.get("public") else "private held-out data"
    line += f" on {evaluation.get('corpus') or where}, step {evaluation.get('step')}"
    return sentences, line


@dataclass(frozen=True, kw_only=True)
class TokenScore:
    """One candidate for one mask position: the vocabulary token and its probability."""

    token: str
    token_id: int
    score: float

    def __post_init__(self) -> None:
        if self.token_id < 0:
            raise ValueError(f"TokenScore.token_id must be >= 0, got {self.token_id}")
        if not 0.0 <= self.score <= 1.0:
            raise ValueError(f"TokenScore.score must be a probability in [0, 1], got {self.score}")


@dataclass(frozen=True, kw_only=True)
class FillMaskResult:
    """Candidates per mask position (left to right, best first) and the top-1 filled sentence."""

    masks: tuple[tuple[TokenScore, ...], ...]
    filled: str


def length_buckets(max_length: int) -> tuple[int, ...]:
    """Padded lengths used for inference: 16, 32, 64, ... below `max_length`, then `max_length`."""
    if max_length < 3:
        raise ValueError(f"max_length must be >= 3 ([CLS], [MASK], [SEP]), got {max_length}")
    buckets = []
    size = _SMALLEST_BUCKET
    while size < max_length:
        buckets.append(size)
        size *= 2
    buckets.append(max_length)
    return tuple(buckets)


class FillMaskModel:
    """A loaded checkpoint ready for fill-mask: tokenizer, Flax MLM, jitted top-k, guarantee."""

    def __init__(
        self,
        *,
        name: str,
        tokenizer: Any,
        model: BertForMaskedLM,
        privacy: ModelPrivacy,
        sentences: tuple[str, ...] = (),
        evaluation: str | None = None,
    ) -> None:
        """`sentences`: the release recipe's own fill-mask sentences (`report.fill_mask`);
        `evaluation`: the held-out figures the release states, as one line (None: none released)."""
        if tokenizer.mask_token_id is None:
            raise ValueError(f"model {name!r}: its tokenizer has no mask token")
        vocab_size = int(model.config.vocab_size)
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"model {name!r}: tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}"
            )
        self.name = name
        self.tokenizer = tokenizer
        self.privacy = privacy
        self.sentences = sentences
        self.evaluation = evaluation
        self.max_length = int(model.config.max_position_embeddings)
        self.buckets = length_buckets(self.max_length)
        self.traced_lengths: list[int] = []  # appended at trace time only: one entry per compile
        graphdef, params = split_params(model)
        self._params = params
        probs = self._make_probs(graphdef)
        self._probs = jax.jit(probs)
        self._top_k = jax.jit(self._make_top_k(probs))

    @classmethod
    def load(cls, source: str, *, name: str | None = None) -> FillMaskModel:
        """Load a local folder or Hub id (through the Hugging Face cache, as `dpbert pull` does).

        A folder that claims privacy must verify (ValueError listing the problems otherwise); one
        that claims nothing loads as non-private.
        """
        folder = resolve_pretrained(source, verify=False)
        privacy = verified_privacy(folder)
        sentences, evaluation = release_notes(folder) if privacy.checks else ((), None)
        return cls(
            name=name or source,
            tokenizer=AutoTokenizer.from_pretrained(str(folder)),
            model=BertForMaskedLM.from_pretrained(str(folder)),
            privacy=privacy,
            sentences=sentences,
            evaluation=evaluation,
        )

    @staticmethod
    def _make_probs(graphdef: Any) -> Callable[..., jax.Array]:
        def probs(params, input_ids, attention_mask, mask_positions):
            logits = mlm_logits(
                graphdef,
                params,
                input_ids,
                attention_mask,
                jnp.zeros_like(input_ids),
                masked_positions=mask_positions,
            )
            return jax.nn.softmax(logits[0].astype(jnp.float32), axis=-1)

        return probs

    def _make_top_k(self, probs: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, jax.Array]]:
        def top_k(params, input_ids, attention_mask, mask_positions):
            self.traced_lengths.append(int(input_ids.shape[1]))
            return jax.lax.top_k(probs(params, input_ids, attention_mask, mask_positions), MAX_TOP_K)

        return top_k

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids (with [CLS]/[SEP]) and mask positions; raises FillMaskInputError if unusable."""
        if not text or not text.strip():
            raise FillMaskInputError(f"Type a sentence with {MASK} where a word is missing.")
        mask_token = self.tokenizer.mask_token
        if mask_token != MASK:
            text = text.replace(MASK, mask_token)
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        positions = [i for i, t in enumerate(ids) if t == self.tokenizer.mask_token_id]
        if not positions:
            also = "" if mask_token == MASK else f" (or {mask_token})"
            raise FillMaskInputError(f"No {MASK}{also} in the sentence: put {MASK} where the model should fill a word.")
        if len(positions) > MAX_MASKS:
            raise FillMaskInputError(
                f"Too many masks: {len(positions)} {MASK} tokens, at most {MAX_MASKS} per sentence."
            )
        if len(ids) > self.max_length:
            raise FillMaskInputError(
                f"Text too long: {len(ids)} tokens with [CLS] and [SEP], but model "
                f"{self.name!r} takes at most {self.max_length} (max_position_embeddings)."
            )
        return ids, positions

    def predict(self, text: str, *, top_k: int = 5) -> FillMaskResult:
        """Top-`top_k` tokens and probabilities at each mask position, left to right."""
        if not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [1, {MAX_TOP_K}], got {top_k}")
        ids, positions = self.encode(text)
        probs, token_ids = jax.device_get(self._top_k(self._params, *self._padded(ids, positions)))
        masks = tuple(
            tuple(
                TokenScore(token=self._token(int(t)), token_id=int(t), score=float(p))
                for p, t in zip(probs[m, :top_k], token_ids[m, :top_k], strict=True)
            )
            for m in range(len(positions))
        )
        for position, candidates in zip(positions, masks, strict=True):
            ids[position] = candidates[0].token_id
        filled = self.tokenizer.decode(ids, skip_special_tokens=True)
        return FillMaskResult(masks=masks, filled=filled)

    def mask_distribution(self, text: str) -> np.ndarray:
        """The model's probabilities over its whole vocabulary at the first mask of `text` (float64);
        raises FillMaskInputError as `predict` does."""
        ids, positions = self.encode(text)
        probs = self._probs(self._params, *self._padded(ids, positions[:1]))[0]
        return np.asarray(jax.device_get(probs), dtype=np.float64)

    def _padded(self, ids: list[int], positions: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, attention_mask, mask_positions), padded to the length bucket and `MAX_MASKS`."""
        length = next(b for b in self.buckets if b >= len(ids))
        input_ids = np.full((1, length), self.tokenizer.pad_token_id or 0, dtype=np.int32)
        input_ids[0, : len(ids)] = ids
        attention_mask = np.zeros((1, length), dtype=np.int32)
        attention_mask[0, : len(ids)] = 1
        # Unused mask slots point at [CLS]; their rows are computed and dropped.
        padded_positions = np.zeros((1, MAX_MASKS), dtype=np.int32)
        padded_positions[0, : len(positions)] = positions
        return input_ids, attention_mask, padded_positions

    def warm_up(self) -> None:
        """Compile the smallest length bucket now, so the first visitor does not wait for it."""
        length = self.buckets[0]
        ids = np.zeros((1, length), dtype=np.int32)
        jax.block_until_ready(self._top_k(self._params, ids, np.ones_like(ids), np.zeros((1, MAX_MASKS), np.int32)))

    def _token(self, token_id: int) -> str:
        # Models may pad the output vocabulary past the tokenizer's; name those ids plainly.
        return self.tokenizer.convert_ids_to_tokens(token_id) or f"<id {token_id}>"
