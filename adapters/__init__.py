"""Engine adapters: kvbroker behind an engine's own KV transfer interface.

- :mod:`kvbroker.adapters.vllm`: a vLLM KV connector (``KVBrokerConnector``).
- :mod:`kvbroker.adapters.sglang`: an SGLang transfer backend
  (``--disaggregation-transfer-backend kvbroker``, registered by the
  ``sglang.srt.plugins`` entry point), with
  :mod:`kvbroker.adapters.bootstrap`, the registry where a prefill engine's
  ranks publish their broker and group.

Each adapter imports its engine; import the one you use.
"""
