"""Size limits shared by Envoy's bootstrap (the layer above renders it) and the processes behind it."""

from __future__ import annotations

#: The largest request body Envoy buffers for the coordinator's decision (`per_connection_buffer_limit_bytes`);
#: a larger body is answered 413 by Envoy.
MAX_BODY_BYTES = 32 * 1024 * 1024
#: The coordinator's gRPC message limit: one ext_proc message carries a whole body plus headers and framing.
MAX_GRPC_MESSAGE_BYTES = MAX_BODY_BYTES + 1024 * 1024
