"""Engine adapters: kvbroker behind an engine's own KV transfer interface.

- :mod:`kvbroker.adapters.vllm`: a vLLM KV connector (``KVBrokerConnector``).

Each adapter imports its engine; import the one you use.
"""
