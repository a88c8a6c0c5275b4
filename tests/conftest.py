"""Test session set-up: 8 simulated CPU devices, so multi-device layouts run on any machine; and
JAX's persistent compilation cache off (JAX's own switch, which `main.py` honours), so that no run of
the suite writes to the user's cache or reads a program compiled by another test.

The flag must be set before JAX initialises its backends, which is why it lives here.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
