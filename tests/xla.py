"""The environment of a test's subprocess that needs several host CPU devices."""

import os


def subprocess_env(devices: int) -> dict[str, str]:
    """os.environ with `devices` host CPU devices (XLA_FLAGS set before jax is imported there),
    keeping the session's other XLA flags (tests/conftest.py), on the CPU platform."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        "JAX_PLATFORMS": "cpu",
    }


def default_codegen_env() -> dict[str, str]:
    """os.environ without the session's codegen flag (tests/conftest.py): for a subprocess whose
    run time, not its compile time, dominates (long schedules of a small model)."""
    from conftest import CODEGEN_FLAG

    flags = os.environ.get("XLA_FLAGS", "").replace(CODEGEN_FLAG, "").strip()
    return {**os.environ, "XLA_FLAGS": flags}
