"""Differentially private word counts: the words a vocabulary may be learned from.

Gaussian partition selection (Korolova et al. 2009, Gopi et al. 2020): each counted unit adds 1 to
each of its first `words_per_unit` distinct words (`bounded_word_counts`), every counted word gets
Gaussian noise scaled to the sensitivity of the guarantee's unit, and a word is kept when its noisy
count exceeds `VocabularyEvent.threshold` (`select_words`).

Guarantees: the kept words and their noisy counts are (epsilon, delta_G + selection_delta)-DP for
add-or-remove one unit of the ledger, (epsilon, delta_G) being the accountant's for the event's
Gaussian mechanism (composed with training's); the noise key comes from the run's secret, never the
recipe's seed. Sensitivities per unit: docs/INTERNALS.md ("dpbert.privacy.vocabulary").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import jax
import numpy as np

from dpbert.privacy.accounting import VocabularyEvent
from dpbert.privacy.noise import gaussian


def unit_words(words: Iterable[str], words_per_unit: int) -> list[str]:
    """The words one unit contributes: its first `words_per_unit` distinct words, in order of first use."""
    kept: dict[str, None] = {}
    for word in words:
        if len(kept) == words_per_unit:
            break
        kept.setdefault(word, None)
    return list(kept)


def bounded_word_counts(units: Iterable[Iterable[str]], words_per_unit: int) -> tuple[Counter[str], int]:
    """(counts, number of units): how many units contribute each word, each unit contributing
    `unit_words(words, words_per_unit)` (each word at most once, at most k words)."""
    if isinstance(words_per_unit, bool) or not isinstance(words_per_unit, int) or words_per_unit < 1:
        raise ValueError(f"words_per_unit: expected an integer >= 1, got {words_per_unit!r}")
    counts: Counter[str] = Counter()
    n = 0
    for words in units:
        counts.update(unit_words(words, words_per_unit))
        n += 1
    return counts, n


def select_words(counts: Counter[str], event: VocabularyEvent, key: jax.Array) -> dict[str, float]:
    """The words whose noisy count exceeds `event.threshold`, with those noisy counts.

    `counts` must come from `bounded_word_counts` with `event.words_per_unit`; `key` must be derived
    from the run's secret (`dpbert.privacy.randomness.mechanism_key`)."""
    words = sorted(counts)
    if not words:
        return {}
    noise = np.asarray(gaussian(key, (len(words),)), dtype=np.float64) * event.noise_stddev
    noisy = np.fromiter((counts[w] for w in words), dtype=np.float64, count=len(words)) + noise
    threshold = event.threshold
    return {w: float(c) for w, c in zip(words, noisy, strict=True) if c > threshold}
