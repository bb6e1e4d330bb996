"""The OpenAI-compatible HTTP server (`headsteer serve`)."""
