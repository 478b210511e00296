"""The connector ``--kv-transfer-config`` names (vLLM's ``KVConnectorFactory``)."""
from __future__ import annotations

import importlib

from lane.kv_transfer.base import KVConnectorBase

CONNECTORS = {
    "ExampleConnector": "lane.kv_transfer.example_connector:ExampleConnector",
    "TcpConnector": "lane.kv_transfer.tcp_connector:TcpConnector",
    "MultiConnector": "lane.kv_transfer.multi_connector:MultiConnector",
}


def create_connector(config, *args, **kwargs) -> KVConnectorBase:
    module, _, cls = CONNECTORS[config.kv_connector].partition(":")
    return getattr(importlib.import_module(module), cls)(config, *args, **kwargs)
