"""Helpers of tests/test_sglang.py: SGLang's queues, built on its CPU pools (not collected by pytest)."""
