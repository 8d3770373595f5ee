"""Reliability and security suite: fault injection, fuzzed input, load and auth (docs/reliability.md)."""
