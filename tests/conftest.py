"""Settings for the whole test session, applied before any test module imports jax.

XLA's CPU backend compiles at LLVM optimisation level 0: the suite compiles hundreds of small
programs and runs most of them for a few steps, so compilation dominates (docs/RESULTS.md, "The test
suite"). Only codegen speed changes; programs that a test compares are compiled alike. Subprocesses keep the flag (`xla.subprocess_env`);
`xla.default_codegen_env` drops it for one whose run time dominates."""

import os

CODEGEN_FLAG = "--xla_backend_optimization_level=0"
if CODEGEN_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CODEGEN_FLAG}".strip()
