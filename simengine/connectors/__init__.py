"""P/D connectors: one module per kind of vLLM KV connector simengine simulates, behind `interface.KVConnector`;
`factory.create_connector` builds the one `--kv-transfer-config` names."""
