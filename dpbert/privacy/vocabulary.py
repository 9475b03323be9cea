"""Differentially private word counts: the words a vocabulary may be learned from.

The mechanism (Gaussian partition selection; Korolova et al. 2009, Gopi et al. 2020, as Google's
differential-privacy library and OpenDP select partitions):

1. Bounded contribution (`bounded_word_counts`): each counted unit (a document, or a window of
   text) adds 1 to the count of each of its first `words_per_unit` distinct words, in order of first
   use, and nothing for any further word: a k-sparse 0/1 vector.
2. Sensitivity for the guarantee's unit (`VocabularyEvent.relation`, `dpbert.privacy.accounting`):
   adding or removing one document under document-level DP moves the counts by sqrt(k) in L2 and 1 in
   any count; one training sequence under sequence-level DP changes one counted document's k words
   for others (sqrt(2k), 1), or meets up to two adjacent windows (`window_sequence_sensitivity`:
   sqrt(32) for k = w = 14, and 2 in any count).
3. Noise and threshold (`select_words`): every counted word gets Gaussian noise of standard
   deviation `noise_multiplier * l2_sensitivity`, drawn with `dpbert.privacy.noise.gaussian` from a
   key the caller derives from the run's secret (words in sorted order, so the draw does not depend on
   the corpus order); a word is kept when its noisy count exceeds `VocabularyEvent.threshold`.

Guarantees: the kept words and their noisy counts are (epsilon, delta_G + selection_delta)-DP for
add-or-remove one unit of the ledger (`VocabularyEvent.unit`), where (epsilon, delta_G) is what the
accountant gives for the `VocabularyEvent`'s Gaussian event (composed with training's in the ledger)
and a word counted in only one of two neighbouring corpora (count at most the L-infinity bound) is
kept with probability at most `per_word_selection_probability` (at most `selection_delta` for all
such words). Nothing here reads the recipe's public seed.
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
