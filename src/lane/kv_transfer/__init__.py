"""Prefill/decode disaggregation (seed step 55): the KV connector API (vLLM v1's shape,
``base``), the connectors that move a request's KV cache between engines, and the factory
that builds the one ``--kv-transfer-config`` names."""
