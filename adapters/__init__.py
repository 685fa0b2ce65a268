"""Engine adapters: kvbroker behind an engine's own KV transfer interface.

- :mod:`kvbroker.adapters.vllm`: a vLLM KV connector (``KVBrokerConnector``).
- :mod:`kvbroker.adapters.sglang`: an SGLang transfer backend
  (``--disaggregation-transfer-backend kvbroker``, registered by the
  ``sglang.srt.plugins`` entry point), with
  :mod:`kvbroker.adapters.bootstrap`, the registry where a prefill engine's
  ranks publish their broker and group.

Each adapter imports its engine; import the one you use. This package
imports none: it holds what needs no engine, how each adapter reads an
engine's room timeouts from its configuration (:func:`room_timeouts_of`,
vLLM's ``kv_connector_extra_config``; :func:`sglang_timeouts`, SGLang's
environment).
"""

from kvbroker.adapters._timeouts import sglang_timeouts
from kvbroker.adapters._vllm_config import room_timeouts_of

__all__ = ["room_timeouts_of", "sglang_timeouts"]
