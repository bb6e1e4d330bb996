"""Backends: Hugging Face transformers (the base), TransformerLens' TransformerBridge and nnsight.

Each backend places its own hooks for the edit engine; the engine never branches on the backend."""
