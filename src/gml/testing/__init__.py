"""Testing helpers for pass authors: random model generation for fuzzing (see docs/fuzzing.md)."""
