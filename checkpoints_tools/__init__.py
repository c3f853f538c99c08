"""Checkpoint tools: GGUF / HF conversion helpers and reference-data generators (not imported by jaxspec)."""
