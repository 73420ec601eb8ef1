"""kvconnect: KV-cache connectors for disaggregated LLM serving.

`kvconnect.vllm.KvconnectConnector` runs any kvconnect connector (nixl, lmcache, flexkv, the
pd composite, or a plugin library) as a vLLM KV connector. The work is done by the native
module `kvconnect._kvconnect`; this package only adapts vLLM's calls and tensors.
"""

from kvconnect._kvconnect import KvconnectError, __version__

__all__ = ["KvconnectError", "__version__"]
