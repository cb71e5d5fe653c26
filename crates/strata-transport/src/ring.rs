//! Cross-worker collectives over a ring of TCP connections.
