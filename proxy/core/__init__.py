"""The I/O-free core: request reading, stream decoding, observing, the record, error classification."""
