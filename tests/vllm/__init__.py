"""Helpers of tests/test_vllm.py: run in vLLM's own processes (not collected by pytest)."""
