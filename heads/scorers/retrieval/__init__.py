"""Retrieval-head scorers: QRHead (query-focused retrieval heads) and its attention retriever."""
