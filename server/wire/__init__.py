"""Wire layer: gRPC servicers (decode, one domain call, encode), proto <-> domain conversion,
and the one table mapping domain errors to status codes. Nothing below imports it."""
