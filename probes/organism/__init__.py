"""A model organism trained here: small Llama-shaped models (one attention-only) trained from
scratch on this CPU, with checkpoints saved as Hugging Face folders (`headsteer build organism`)."""
