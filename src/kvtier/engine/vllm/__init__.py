"""The vLLM KV connector (needs vLLM): ``KVTierConnector``, loaded by vLLM
from ``kv_connector_module_path="kvtier.engine.vllm"``."""

from kvtier.engine.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
