"""The best a one-run audit of a DP-SGD mechanism can give, without training anything.

Simulates the white-box gradient audit's scores (`dpbert.privacy.gradient_canaries`) for the
ideal mechanism itself: m canaries, each in with probability 1/2; at each of T steps an included
canary is Poisson-sampled at rate q and then adds its clipped gradient C to its own coordinate,
which gets N(0, (sigma C)^2) noise; the auditor sums the per-step Neyman-Pearson log-likelihood
ratios, exactly as the real audit does. The bounds (`dpbert.privacy.audit_bounds.audit_scores`,
Steinke et al. 2023 and the f-DP bound of Mahloujifar et al. 2025) on these scores are what a
perfect implementation of the mechanism yields: the ceiling of the method at m canaries, to read
beside what `dpbert audit --kind gradient` measures on the real engine.

Defaults: the tiny recipe's plan (1,100 steps, q = 1024 / 180,000, sigma calibrated to epsilon 8
at delta 1e-6 with RDP, clip 1). Run: `python benchmarks/audit_ceiling.py [--canaries 1000 10000
100000 1000000] [--target-epsilon 2 4 8 16] [--seeds 0 1]`.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from dpbert.privacy.accounting import calibrate_noise_multiplier, sampling_rate
from dpbert.privacy.audit_bounds import audit_scores
from dpbert.privacy.schedule import BatchSchedule


def ideal_scores(
    rng: np.random.Generator, included: np.ndarray, *, q: float, sigma: float, steps: int, chunk: int = 8192
) -> np.ndarray:
    """float64 [m]: each canary's summed per-step log-likelihood ratio under the ideal mechanism
    (the canary's gradient norm above the clip norm, so a member adds C; in units of sigma C)."""
    mu = 1.0 / sigma
    scores = np.empty(included.size)
    for start in range(0, included.size, chunk):
        inc = included[start : start + chunk]
        sampled = (rng.random((steps, inc.size)) < q) & inc
        y = rng.standard_normal((steps, inc.size)) + mu * sampled
        scores[start : start + chunk] = np.logaddexp(np.log1p(-q), math.log(q) + mu * y - mu * mu / 2).sum(axis=0)
    return scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--canaries", type=int, nargs="+", default=[1000, 10000, 100000, 1000000])
    p.add_argument("--target-epsilon", type=float, nargs="+", default=[8.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--dataset-size", type=int, default=180000)
    p.add_argument("--delta", type=float, default=1e-6)
    p.add_argument("--confidence", type=float, default=0.95)
    args = p.parse_args()
    q = sampling_rate(args.batch, args.dataset_size)
    print(
        f"ideal one-run audit: {args.steps} steps, q = {q:.5f}, delta {args.delta:g}, {args.confidence:.0%} confidence"
    )
    print("| epsilon | sigma | canaries | seed | Steinke | f-DP | f-DP guesses (correct) | seconds |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for eps in args.target_epsilon:
        schedule = calibrate_noise_multiplier(
            BatchSchedule.constant(steps=args.steps, expected_batch_size=args.batch, noise_multiplier=1.0),
            dataset_size=args.dataset_size,
            target_epsilon=eps,
            delta=args.delta,
            accountant="rdp",
        )
        sigma = schedule.stages[0].noise_multiplier
        for m in args.canaries:
            for seed in args.seeds:
                start = time.perf_counter()
                rng = np.random.default_rng(seed)
                included = rng.random(m) < 0.5
                scores = ideal_scores(rng, included, q=q, sigma=sigma, steps=args.steps)
                a = audit_scores(scores, included, delta=args.delta, confidence=args.confidence)
                print(
                    f"| {eps:g} | {sigma:.4f} | {m:,} | {seed} | {a.epsilon_lower_bound:.3f} | "
                    f"{a.epsilon_lower_bound_fdp:.3f} | {a.fdp_num_guesses} ({a.fdp_num_correct}) | "
                    f"{time.perf_counter() - start:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
